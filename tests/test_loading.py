"""hyco/base/loading.py's fp32 load of a BF16 checkpoint: loaded at BF16, widened in place.

`from_pretrained(dtype=float32)` on a BF16 checkpoint peaked at ~2.7x the fp32 model (issue 13:
11+ GB for the 2,816-wide verifier stand-in); load_pretrained now loads at the checkpoint's dtype
and widens one tensor at a time. The result must be the fp32 load exactly: every parameter and
every buffer, value and dtype, on two different architectures (verifier and MTP head)."""

import pytest
import torch


def _fp32_reference(folder):
    """transformers' own fp32 load, text-only as load_pretrained loads a multimodal wrapper."""
    from transformers import AutoModelForCausalLM

    from hyco.base.loading import text_only_config

    config = text_only_config(folder)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **({"config": config} if config else {}))


@pytest.mark.parametrize("what", ["verifier", "assistant"])
def test_bf16_checkpoint_loads_as_the_fp32_load_tensor_by_tensor(tiny_family, what):
    from hyco.base.loading import checkpoint_files, load_pretrained

    folder = tiny_family[what]
    assert {dtype for dtype, _, _ in checkpoint_files(folder).values()} == {"BF16"}  # the upcast path runs
    ours, want = load_pretrained(folder, what, dtype=torch.float32), _fp32_reference(folder)
    for kind in ("named_parameters", "named_buffers"):
        got, ref = dict(getattr(ours, kind)()), dict(getattr(want, kind)())
        assert got.keys() == ref.keys(), kind
        for name, tensor in ref.items():
            assert got[name].dtype == tensor.dtype, name
            assert torch.equal(got[name], tensor), name
    assert ours.config.dtype == torch.float32
    if what == "verifier":  # the head's forward needs a backbone's states; equal tensors suffice
        ids = torch.arange(1, 9)[None]
        assert torch.equal(ours(ids).logits, want(ids).logits)


def test_naive_widening_would_keep_bf16_rounded_init_buffers(tiny_family):
    """Why the skeleton: a BF16 load + .float() keeps buffers computed at BF16 (embed_scale),
    which differ from the fp32 load; so the test above can fail."""
    from transformers import AutoModelForCausalLM

    from hyco.base.loading import text_only_config

    config = text_only_config(tiny_family["verifier"])
    naive = AutoModelForCausalLM.from_pretrained(str(tiny_family["verifier"]), dtype=torch.bfloat16, config=config).float()
    want = dict(_fp32_reference(tiny_family["verifier"]).named_buffers())
    assert any(not torch.equal(b, want[n]) for n, b in naive.named_buffers())


def test_all_finite_finds_a_nan_or_inf_in_any_block():
    from hyco.base.loading import all_finite

    t = torch.zeros(10, 7)
    assert all_finite(t, block=8)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (0, 33, 69):  # first block, a middle one, the short last one
            u = t.clone()
            u.view(-1)[where] = bad
            assert not all_finite(u, block=8)
