"""Quantized graphs as tools: integer grids, INT2 blocks and INT4 MatMuls, another integer
implementation (`perturb`), the HTP-vs-CPU pass rule, the QDQ graphs run by torch. Imports
hyco.npu and below."""
