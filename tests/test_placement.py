"""The verifier's placement (recipe section `placement`, hyco.base.loading.load_verifier): BF16 on any
device is transformers' own BF16 model, and CPU + disk offload through accelerate computes what
the model in memory computes, down to the answers the answers stage writes."""

from __future__ import annotations

import filecmp

import pytest
import torch

from hyco.base.errors import HycoError
from hyco.base.loading import load_verifier
from hyco.config.recipe import AnswersConfig, PlacementConfig

IDS = torch.tensor([[2, 105, 300, 400, 500, 600, 106, 700, 800]])


def test_bf16_placement_is_transformers_own_bf16_model(tiny_family):
    from transformers import Gemma4ForConditionalGeneration

    ours = load_verifier(tiny_family["verifier"], PlacementConfig(dtype="bfloat16"))
    reference = Gemma4ForConditionalGeneration.from_pretrained(str(tiny_family["verifier"]), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        a, b = ours(input_ids=IDS).logits, reference(input_ids=IDS).logits
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    buffers = dict(ours.get_input_embeddings().named_buffers())
    assert buffers and all(torch.equal(t, dict(reference.get_input_embeddings().named_buffers())[n])
                           for n, t in buffers.items())


def test_cpu_and_disk_offload_computes_what_memory_computes(tiny_family, tmp_path):
    offloaded = load_verifier(tiny_family["verifier"], PlacementConfig(dtype="float32", max_memory={"cpu": "2MB"},
                                                                       offload_folder=str(tmp_path / "offload")))
    assert "disk" in set(offloaded.hf_device_map.values()), offloaded.hf_device_map
    resident = load_verifier(tiny_family["verifier"], PlacementConfig(dtype="float32"))
    with torch.no_grad():
        assert torch.equal(offloaded(input_ids=IDS).logits, resident(input_ids=IDS).logits)


def test_offloaded_answers_are_byte_identical(ladder, tiny_family, tmp_path):
    from hyco.answers.stage import make_answers

    config = AnswersConfig(source="greedy", max_new_tokens_train=8, max_new_tokens_eval=6, max_prompt_tokens=48)
    for name, placement in (("memory", PlacementConfig()),
                            ("offload", PlacementConfig(max_memory={"cpu": "2MB"}, offload_folder=str(tmp_path / "o")))):
        (tmp_path / name).mkdir()
        make_answers(verifier=tiny_family["verifier"], tokenizer=tiny_family["tokenizer"], vocab=ladder / "vocab",
                     config=config, out=tmp_path / name, placement=placement)
    assert filecmp.cmp(tmp_path / "memory" / "answers.jsonl", tmp_path / "offload" / "answers.jsonl", shallow=False)


def test_placement_is_validated():
    with pytest.raises((HycoError, ValueError), match="placement.device_map must be"):
        PlacementConfig(device_map="everywhere")


def quantized_copy(verifier, dst, method: str):
    """The verifier's folder with its config saying `method` (the tensors stay float: what is
    tested is the refusal before any tensor is read)."""
    import json
    import shutil

    shutil.copytree(verifier, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("method, package", [("awq", "gptqmodel"), ("gptq", "optimum and gptqmodel"),
                                             ("compressed-tensors", "compressed-tensors")])
def test_a_quantized_verifier_without_its_backend_is_one_line_naming_the_package(tiny_family, tmp_path, method,
                                                                                  package, monkeypatch):
    """Each backend as if not installed (compressed-tensors is: a dependency; the other two are
    not), so the refusal is seen for all three."""
    import importlib.util

    from hyco.base.loading import SERVER_QUANT

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in SERVER_QUANT[method] else find_spec(name, *a))
    folder = quantized_copy(tiny_family["verifier"], tmp_path / "verifier", method)
    with pytest.raises(HycoError) as e:
        load_verifier(folder, PlacementConfig())
    said = str(e.value)
    assert "\n" not in said and str(folder / "config.json") in said and repr(method) in said, said
    assert any(f"the {p} package" in said for p in (package, package.split(" and ")[-1])), said


def test_an_unknown_quantization_and_a_quantized_teacher_are_refused(tiny_family, tmp_path):
    from hyco.pipeline.preflight import check_model, check_teacher

    folder = quantized_copy(tiny_family["verifier"], tmp_path / "verifier", "bitsandbytes")
    with pytest.raises(HycoError, match=r"must be a float checkpoint or quantized with one of awq, gptq, "
                                        r"compressed-tensors, but its quant_method is 'bitsandbytes'"):
        check_model("verifier", folder)
    awq = quantized_copy(tiny_family["verifier"], tmp_path / "awq", "awq")
    with pytest.raises(HycoError, match=r"models.verifier is quantized \('awq'\).*qat.quantized_teacher: true"):
        check_teacher(awq, quantized_teacher=False)
    check_teacher(awq, quantized_teacher=True)  # opted in
    check_teacher(tiny_family["verifier"], quantized_teacher=False)  # a float teacher
