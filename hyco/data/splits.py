"""The evaluation partition of a chat corpus: one rule, shared by everything that trains or evaluates.

Acceptance figures (the check's MATs, qat's held-out KL, calibrate's fidelity) are worth something
only on prompts no model was trained on. The fixtures' distillation runs before the vocab stage
picks its reserved evaluation prompts, so disjointness cannot come from bookkeeping; it comes
from a rule both sides apply to each conversation on its own:

- a conversation is in the evaluation partition when a hash of its group falls in one bucket of
  `EVAL_BUCKETS`;
- the vocab stage deals evaluation prompts from this partition only, and no training prompt;
- the fixtures' distillation (tokenizer text, verifier corpus, drafter prompts) skips it.

The group is the conversation id without a trailing `_<n>`: ShareGPT dumps split a long
conversation into parts `abc_0`, `abc_7`, ... that repeat a turn of their neighbour, so an
evaluation prompt would otherwise appear verbatim, with its answer, in a training part (keyed
on the prompt text, 6 of the tiny recipe's 16 evaluation prompts did). What stays shared is text
that different people typed alike ("continue", "Hello"). The hash is salted so the partition
does not line up with other hashes.
"""

from __future__ import annotations

import hashlib
import re

from hyco.data.chat import Conversation

EVAL_BUCKETS = 8  # one conversation in eight
_SALT = b"hyco-eval-partition-v1\0"


def partition_key(conversation: Conversation) -> str:
    """What the partition hashes: the conversation's group, its id without a part suffix `_<n>`."""
    return "group:" + re.sub(r"_\d+$", "", conversation.id)


def is_evaluation(conversation: Conversation) -> bool:
    digest = hashlib.sha256(_SALT + partition_key(conversation).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % EVAL_BUCKETS == 0
