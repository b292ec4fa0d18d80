"""Per-configuration figures from the decode logs (the columns of the check report).

- MAT: tokens committed per verification round (accepted draft tokens + the bonus; section 3.1).
- Chain acceptance per depth k: the share of rounds whose first k chain tokens were all accepted
  (cumulative) and its ratio to depth k-1 (conditional; the paper's 0.65-0.68 per depth).
- Accepted tokens by source (chain / sibling / SLM), bonus tokens outside the keep set.
- Bytes: the hand-off's fixed part per round (e, h), its K/V part per committed token, the first
  reply, and the tree message per round.
- Verifier passes per output token (prefill included; none for the SLM alone), drafter time per
  round (for the SLM alone: per token, its delivery reference); with proactive drafting, its time
  per round and the share of its bets the verifier's reply made good.
- How much the epsilon rule can add: the mean count of tokens with p~ >= epsilon per tree row
  (root included; every row the verifier evaluated), the mean top probability per row, and the
  share of committed tokens the verifier did not sample (accepted by the threshold alone; 0 under
  exact verification). A verifier whose p~ spreads over dozens of tokens above epsilon accepts
  almost any draft, and a MAT measured there says little about drafting.
"""

from __future__ import annotations

from statistics import mean

import numpy as np

from hyco.runtime.decode import DecodeLog
from hyco.runtime.tree import SOURCES


def summarize(logs: list[DecodeLog], keep_ids: np.ndarray | None, chain_depth: int) -> dict:
    rounds = [r for log in logs for r in log.rounds]
    output_tokens = sum(len(log.tokens) for log in logs)
    accepted = [s for r in rounds for s in r.accepted_sources]
    chain_rounds = [r for r in rounds if r.chain_planted]
    cumulative = [_share(sum(r.chain_depth_reached >= k for r in chain_rounds), len(chain_rounds))
                  for k in range(1, chain_depth + 1)] if chain_rounds else []
    conditional = [_share(sum(r.chain_depth_reached >= k for r in chain_rounds),
                          sum(r.chain_depth_reached >= k - 1 for r in chain_rounds))
                   for k in range(1, len(cumulative) + 1)]
    keep = set(keep_ids.tolist()) if keep_ids is not None else None
    kv_rows = sum(sum(log.wire_kv_rows) for log in logs)
    committed = sum(r.committed for r in rounds)
    tree_rows = sum(r.tree_nodes + 1 for r in rounds)
    return {
        "prompts": len(logs),
        "output_tokens": output_tokens,
        "rounds": len(rounds),
        "mat": _avg([r.committed for r in rounds]),
        "accepted_per_round": _avg([len(r.accepted_sources) for r in rounds]),
        "chain_acceptance_cumulative": cumulative,
        "chain_acceptance_conditional": conditional,
        "accepted_share_by_source": {s: _share(accepted.count(s), len(accepted)) for s in SOURCES},
        "bonus_outside_keep_share": (_share(sum(r.bonus is not None and r.bonus not in keep for r in rounds),
                                            sum(r.bonus is not None for r in rounds)) if keep else 0.0),
        "tokens_at_epsilon_per_row": _share(sum(r.rows_at_epsilon for r in rounds), tree_rows),
        "top_probability_per_row": _share(sum(r.top_probability_sum for r in rounds), tree_rows),
        "committed_unsampled_share": _share(sum(r.unsampled for r in rounds), committed),
        # None where nothing crosses the link (no MTP head, or the head runs on the server).
        "handoff_bytes_per_round": _avg([b for log in logs for b in log.wire_per_round]) if kv_rows else None,
        "handoff_kv_bytes_per_committed_token": _share(sum(sum(log.wire_kv) for log in logs), kv_rows) if kv_rows else None,
        "first_reply_bytes": _avg([log.first_reply_bytes for log in logs if log.first_reply_bytes]) if kv_rows else None,
        "tree_bytes_per_round": _avg([r.tree_bytes for r in rounds]),
        "tree_nodes_per_round": _avg([r.tree_nodes for r in rounds]),
        "verifier_passes_per_output_token": _share(sum(len(log.rounds) + 1 for log in logs if log.verified),
                                                   output_tokens),
        "drafter_ms_per_round": 1e3 * _avg([r.draft_s for r in rounds]),
        # proactive drafting (specedge-pd): its time per round, off the critical path while the
        # reply is in flight, and the share of its bets won (the next tree started from the bet)
        "pd_ms_per_round": 1e3 * _avg([r.pd_s for r in rounds]),
        "pd_win_share": _share(sum(log.pd_wins for log in logs), sum(log.pd_bets for log in logs)),
    }


def _avg(values: list[float]) -> float:
    return float(mean(values)) if values else 0.0


def _share(part: float, whole: float) -> float:
    return float(part / whole) if whole else 0.0
