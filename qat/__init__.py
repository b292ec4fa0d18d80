"""4-bit KL quantization-aware training of the gemma4_assistant MTP head and its static drafting-step graph."""
