"""Sessions and binaries: onnxruntime CPU sessions (`ort`), QNN HTP context binaries and their
metadata (`contexts`, `system`), the bundle the phone loads (`bundle`). Imports hyco.quant and below."""
