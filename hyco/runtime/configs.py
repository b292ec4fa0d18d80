"""The configurations of the paper's Table 5 (and section 4.2), as a registry.

Every device tree uses the SLM Drafter with the keep set and the 1,024-token ring; the numbers
(K, sibling depths, budget, rate, epsilon, SLM passes) come from the recipe's `check` section, so
the tiny recipe and the paper share one table:

| name       | MTP head            | K | siblings | SLM passes | nodes      | acceptance |
|------------|---------------------|---|----------|------------|------------|------------|
| hyco       | phone, keep set, 1K | 4 | 1-2      | 1          | 32         | epsilon    |
| hyco-exact | phone, keep set, 1K | 4 | 1-2      | 1          | 32         | exact      |
| hyco-2p    | phone, keep set, 1K | 4 | 1-2      | 2          | 32         | epsilon    |
| specedge   | none                | 0 | -        | 4          | 32         | exact      |
| specedge-eps | none              | 0 | -        | 4          | 32         | epsilon    |
| specedge-pd | none               | 0 | -        | 4 + PD     | 32         | exact      |
| cloud-mtp  | server, full vocab, whole prefix | 4 | - | 0     | 4          | exact      |
| hyco-server-head | server, full vocab, whole prefix | 4 | 1-2 | 1 | 32       | epsilon    |
| slm-alone  | none                | 0 | -        | 1 a token  | -          | none: no server |

`specedge-pd` is SpecEdge-style with proactive drafting: while a reply is in flight the phone bets
on its best path and drafts `check.pd_passes` passes beyond it (`TreeDrafter.proactive`); when the
verifier accepts that whole path and its bonus is one of the bet's children, the next tree starts
from what was drafted under the bonus. `slm-alone` is the paper's delivery reference: the SLM
Drafter on the phone decodes by itself, one pass a token, each token sampled from its own
top-`slm_topk` (`decode.decode_alone`).

Through the token bridge (a verifier of another family, `models.verifier_tokenizer`; the check's
`runtime_check/bridged.py`), `BRIDGE_CONFIGS`:

| name           | drafter                          | acceptance | what it is for                  |
|----------------|----------------------------------|------------|---------------------------------|
| bridge-slm     | SLM-only tree, mapped per round  | exact      | lossless through the bridge     |
| bridge-slm-eps | SLM-only tree, mapped per round  | epsilon    | the bridge under the paper's rule |
| verifier-alone | none: one verifier pass a token  | none       | the server's cost reference     |
| cloud-mtp      | the verifier's own head (server) | exact      | Cloud+head, where one is named  |

`X@float` / `X@deployed`: configuration X with the phone's drafters on the other numerics
(check.drafters; backend onnxruntime), so the report pairs X with its float twin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hyco.base.errors import HycoError
from hyco.config.recipe import CheckConfig


@dataclass(frozen=True)
class DecodeConfig:
    name: str
    label: str  # as the paper names it
    mtp_depth: int  # K; 0: no MTP chain
    mtp_on_server: bool  # Cloud+MTP: float head, full vocabulary, whole prefix, nothing on the wire
    sibling_depths: tuple[int, ...]
    slm_passes: int
    epsilon: float  # 1.0: exact verification
    budget: int
    rate: float
    slm_edge_cost: float  # added per SLM edge: ln(rate) in the hybrid tree, 0 in the SLM-only tree
    slm_topk: int  # children the SLM proposes under each node it expands
    drafters: str = "deployed"  # the phone's numerics under backend onnxruntime (check.drafters)
    alone: bool = False  # the SLM decodes by itself: no server, no verification (slm-alone)
    pd_passes: int = 0  # proactive drafting: SLM passes while the reply is in flight (specedge-pd)
    bridged: bool = False  # the SLM drafts for a verifier of another tokenizer (hyco/runtime/bridge.py)
    verifier_alone: bool = False  # no drafter: the verifier decodes by itself, one pass a token


def _hybrid(check: CheckConfig, name: str, label: str, passes: int, epsilon: float,
            head_on_server: bool = False) -> DecodeConfig:
    return DecodeConfig(name, label, check.chain_depth, head_on_server, check.sibling_depths, passes, epsilon,
                        check.budget, check.rate, math.log(check.rate), check.slm_topk)


def _slm_only(check: CheckConfig, name: str, label: str, epsilon: float) -> DecodeConfig:
    # SpecEdge-style: a 32-node tree in four sequential SLM passes, scored by the SLM's own
    # cumulative log-probability (EAGLE-2-style expansion of the best new nodes).
    return DecodeConfig(name, label, 0, False, (), check.specedge_passes, epsilon, check.budget, check.rate,
                        0.0, check.slm_topk)


CONFIGS = {
    "hyco": lambda c: _hybrid(c, "hyco", "HyCo", c.slm_passes, c.epsilon),
    "hyco-exact": lambda c: _hybrid(c, "hyco-exact", "HyCo exact", c.slm_passes, 1.0),
    "hyco-2p": lambda c: _hybrid(c, "hyco-2p", "HyCo-2P", 2, c.epsilon),
    "specedge": lambda c: _slm_only(c, "specedge", "SpecEdge-style", 1.0),
    "specedge-eps": lambda c: _slm_only(c, "specedge-eps", "SpecEdge-eps", c.epsilon),
    "specedge-pd": lambda c: replace(_slm_only(c, "specedge-pd", "SpecEdge-style + PD", 1.0), pd_passes=c.pd_passes),
    "cloud-mtp": lambda c: DecodeConfig("cloud-mtp", "Cloud+MTP", c.chain_depth, True, (), 0, 1.0,
                                        c.chain_depth, c.rate, 0.0, c.slm_topk),
    # the paper's device head against its BF16 server head: the same hybrid tree, the head run by
    # the server (float, full vocabulary, whole prefix), the SLM on the phone
    "hyco-server-head": lambda c: _hybrid(c, "hyco-server-head", "HyCo, head on server", c.slm_passes, c.epsilon,
                                          head_on_server=True),
    "slm-alone": lambda c: DecodeConfig("slm-alone", "SLM alone", 0, False, (), 1, 1.0, 1, c.rate, 0.0, c.slm_topk,
                                        alone=True),
}
BRIDGE_CONFIGS = {
    "bridge-slm": lambda c: replace(_slm_only(c, "bridge-slm", "SLM via token bridge", 1.0), bridged=True),
    "bridge-slm-eps": lambda c: replace(_slm_only(c, "bridge-slm-eps", "SLM via token bridge, eps", c.epsilon),
                                        bridged=True),
    "verifier-alone": lambda c: DecodeConfig("verifier-alone", "Verifier alone", 0, False, (), 0, 1.0, 0, c.rate,
                                             0.0, c.slm_topk, verifier_alone=True),
    "cloud-mtp": lambda c: replace(CONFIGS["cloud-mtp"](c), label="Cloud+head"),
}
NUMERICS = ("deployed", "float")


def decode_config(name: str, check: CheckConfig, *, bridged: bool = False) -> DecodeConfig:
    """`bridged`: the configurations of a check through the token bridge (`BRIDGE_CONFIGS`)."""
    registry = BRIDGE_CONFIGS if bridged else CONFIGS
    base, _, numerics = name.partition("@")
    if base not in registry or (numerics and numerics not in NUMERICS):
        other = "the token bridge's" if bridged else "a same-tokenizer check's"
        raise HycoError(f"check.configs: unknown configuration {name!r} for {other} check (supported: "
                        f"{', '.join(registry)}, each optionally @{' or @'.join(NUMERICS)})")
    cfg = registry[base](check)
    if not numerics:
        return replace(cfg, drafters=check.drafters)
    return replace(cfg, name=name, label=f"{cfg.label} ({numerics} drafters)", drafters=numerics)
