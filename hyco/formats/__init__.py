"""The checkpoint formats, bit-exact: Google's QAT-mobile packing (`gemma_quant`), compressed-tensors'
pack-quantized layout (`ct_format`), ONNX INT4 raw data (`int4`). Imports hyco.config and hyco.base."""
