"""The NPU building blocks: the ops both static graphs stack (`ops`), the host side of the phone
(`host`, `embed_lut`, `handoff`, `captures`), the keep-set head (`restrict`), every graph's I/O
(`io_spec`). Imports hyco.data and below."""
