"""One error type for bad input: the CLI prints its message on one line and exits 2."""


class HycoError(Exception):
    """A problem with the user's input (file, tensor, recipe), stated so it can be fixed.

    The message names the file and, where there is one, the tensor or key.
    """
