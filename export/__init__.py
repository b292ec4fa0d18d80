"""QNN HTP context binaries for the Snapdragon SM8850 (onnxruntime-qnn offline, or qai-hub) and the bundle manifest."""
