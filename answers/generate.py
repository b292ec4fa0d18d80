"""The verifier's answers to the reserved prompts (recipe section `answers`, `source`):

- `greedy`: the verifier's greedy continuation, as the paper does (appendix: 1,024 new tokens
  for training, 512 for evaluation). On a weak verifier this loops on one token; see the stats.
- `sampled`: the verifier's continuation sampled at `temperature` with top-k / top-p, each
  prompt with its own seed (`seed + position in the prompt list`), so reruns are identical.
  With the check's sampling settings this is the text the runtime drafts for.
- `corpus`: the conversation's own first assistant turn, teacher-forced
  (`hyco.data.answers.corpus_answer_ids`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from hyco.base.console import progress
from hyco.base.errors import HycoError
from hyco.config.recipe import AnswersConfig
from hyco.data.answers import SOURCES, corpus_answer_ids, end_of_turn_id, eos_ids_of, prompt_ids


def translate_answer(answer: list[int], eos: set[int], verifier_tokenizer, tokenizer, end_of_turn: int) -> list[int]:
    """A verifier's answer in another tokenizer's ids (the token bridge's verifier of another
    family): its text re-tokenized, a character left unfinished by the length limit cut, and the
    end of turn, when the verifier ended its turn, as `tokenizer`'s chat template writes it."""
    from hyco.runtime.bridge import complete_text, encode

    ended = bool(answer) and answer[-1] in eos
    text, _ = complete_text(verifier_tokenizer, [t for t in answer if t not in eos])
    return encode(tokenizer, text)[0] + ([end_of_turn] if ended else [])


def generate_answers(verifier, tokenizer, prompts: list[dict], config: AnswersConfig, *,
                     positions: Iterable[int] | None = None, verifier_tokenizer=None,
                     slm_eos: Iterable[int] = ()) -> Iterator[dict]:
    """Yield one answer record per prompt (see the module doc); `prompts` are vocab/'s records
    {"id", "index", "split", "turns"}; `config` the answers section (source, sampling, lengths
    per split, prompt cut). Greedy and sampled answers stop at the first EOS.
    `positions`: only these prompts (a process's share of a launch; the seed stays keyed by the
    position in `prompts`). `verifier_tokenizer`: a verifier of another family (the token
    bridge): it answers its own chat template's prompt, and the record holds the prompt and the
    answer's text in `tokenizer`'s ids, the SLM's (`slm_eos`: its end-of-turn ids, which also end
    a corpus answer)."""
    import torch  # here, not at the top: the CLI imports this module to build its --help

    source, seed, max_prompt_tokens = config.source, config.seed, config.max_prompt_tokens
    max_new_tokens = {"train": config.max_new_tokens_train, "eval": config.max_new_tokens_eval}
    if source not in SOURCES:
        raise HycoError(f"answers.source must be one of {list(SOURCES)}, but got {source!r}")
    eos = eos_ids_of(verifier)
    slm_eos = set(slm_eos)
    if verifier_tokenizer is not None and not slm_eos:
        raise HycoError("answers for a verifier of another family need the SLM's end-of-turn ids")
    end_of_turn = end_of_turn_id(tokenizer, slm_eos) if verifier_tokenizer is not None else None
    device = verifier.device
    positions = list(range(len(prompts)) if positions is None else positions)
    for i in progress(positions, desc=f"answers ({source})", unit="prompt", disable=None):
        rec = prompts[i]
        ids = prompt_ids(tokenizer, rec["turns"], max_prompt_tokens)
        limit = max_new_tokens[rec["split"]]
        if source == "corpus":
            answer = corpus_answer_ids(tokenizer, rec["turns"], limit, slm_eos or eos)
        else:
            kwargs: dict[str, Any] = {"do_sample": False}
            if source == "sampled":
                torch.manual_seed(seed + i)  # per prompt: the same answer whatever else is generated
                kwargs = {"do_sample": True, "temperature": config.temperature, "top_k": config.top_k,
                          "top_p": config.top_p}
            asked = ids if verifier_tokenizer is None else prompt_ids(verifier_tokenizer, rec["turns"], max_prompt_tokens)
            out = verifier.generate(torch.tensor([asked], device=device), max_new_tokens=limit,
                                    pad_token_id=(verifier_tokenizer or tokenizer).pad_token_id, **kwargs)
            answer = out[0, len(asked):].tolist()
            ends = [k for k, t in enumerate(answer) if t in eos]
            answer = answer[:ends[0] + 1 if ends else len(answer)]
            if verifier_tokenizer is not None:
                answer = translate_answer(answer, eos, verifier_tokenizer, tokenizer, end_of_turn)
        yield {"id": rec["id"], "index": rec.get("index"), "split": rec["split"], "source": source,
               "prompt_ids": ids, "answer_ids": answer}
