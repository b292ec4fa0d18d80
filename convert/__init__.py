"""Graph surgery: the E2B QAT checkpoint to static integer NPU graphs (tree and prefill), CPU embedding LUTs, host rotary tables and KV rings."""
