"""The answers stage: the verifier's answers to vocab's reserved prompts (`generate.py`), written in
the answers contract (`hyco.data.answers`) that qat and calibrate read. Like every stage it
imports the core only."""
