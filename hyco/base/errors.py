"""Error types the CLI maps to exit codes.

- `HycoError` (exit 2): bad input (file, tensor, recipe), stated so it can be fixed.
- `ProofFailed` (exit 1): the input was fine, but a stage's own proof (bit-exact weights,
  parity against the reference) failed, so the stage moved nothing into place.
"""


class HycoError(Exception):
    """A problem with the user's input (file, tensor, recipe), stated so it can be fixed.

    The message names the file and, where there is one, the tensor or key.
    """


class ProofFailed(Exception):
    """A stage's bit-exact or parity proof failed. The message is one line naming the check
    and the figure; `--allow-parity-failure` (recipe key `allow_parity_failure`) writes the
    artifacts anyway and marks their manifest."""

