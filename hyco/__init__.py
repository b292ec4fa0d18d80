"""hyco-convert: HyCo drafters (Gemma 4 E2B QAT SLM + MTP head) to static integer NPU graphs.

The core, in rooms named for what each knows, each importing only the rooms under it (the
contract in pyproject.toml, docs/design.md): pipeline, runtime, qnn, quant, npu, data, formats,
config, base. Each stage lives in its own top-level folder, installed as `hyco.<stage>`, and
imports the core only.
"""

__version__ = "0.1.0"
