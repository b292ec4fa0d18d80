"""The keep set: the restricted output vocabulary both drafters predict over, with its coverage report."""
