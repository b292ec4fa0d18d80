"""The hybrid-decoding runtime every checking stage drives: the draft tree, the drafters on
torch, onnxruntime or the HTP, the reference verifier, acceptance and the decode loop. Imports hyco.qnn
and below, never the pipeline."""
