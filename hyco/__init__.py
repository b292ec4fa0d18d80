"""hyco-convert: HyCo drafters (Gemma 4 E2B QAT SLM + MTP head) to static integer NPU graphs.

The core package holds the CLI, the recipe schema and the formats several stages share; each
stage lives in its own top-level folder, installed as `hyco.<stage>`.
"""

from hyco.errors import HycoError

__all__ = ["HycoError"]
__version__ = "0.1.0"
