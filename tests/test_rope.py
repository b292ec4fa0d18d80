"""One Rope for the SLM's host and the MTP step (hyco/npu/host.py): transformers' own inverse
frequencies from rope.json, with its attention_scaling applied to cos and sin, as
Gemma4TextRotaryEmbedding does. A family whose RoPE scales (YaRN here: 1 + 0.1 ln 4 = 1.139) and
partial rotary (Gemma 4's proportional full-attention layers: three quarters of the frequencies 0)
against transformers' own rotary embedding, to one float32 ulp (numpy's cos and sin and torch's
round differently in the last bit now and then; 2.4e-7 is one ulp at the YaRN scale of 1.139)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch


def rotary(tiny_family, sliding: dict):
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    config = json.loads((tiny_family["slm"] / "config.json").read_text())
    text = dict(config.get("text_config", config))
    text["rope_parameters"] = {**text["rope_parameters"], "sliding_attention": sliding}
    config = Gemma4TextConfig(**{k: v for k, v in text.items() if k not in ("model_type", "architectures")})
    return config, Gemma4TextRotaryEmbedding(config)


@pytest.mark.parametrize("sliding", [
    {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 8192},
    {"rope_type": "default", "rope_theta": 10000.0},
])
def test_host_rope_and_the_mtp_rows_equal_transformers(tiny_family, sliding):
    from types import SimpleNamespace

    from hyco.convert.stage import rope_json

    from hyco.npu.host import Rope
    from hyco.runtime.mtp import rope_rows

    config, rot = rotary(tiny_family, sliding)
    rope = Rope.from_json(json.loads(json.dumps(rope_json(SimpleNamespace(rotary_emb=rot), config, {}))))
    positions = np.array([0, 1, 7, 511, 4095])
    scales = {}
    for layer_type in rot.layer_types:
        cos, sin = rot(torch.zeros(1, dtype=torch.float32), torch.from_numpy(positions)[None], layer_type)
        host_cos, host_sin = rope.tables(layer_type, positions)
        np.testing.assert_allclose(host_cos, cos[0].numpy(), rtol=0, atol=2.4e-7)
        np.testing.assert_allclose(host_sin, sin[0].numpy(), rtol=0, atol=2.4e-7)
        table = {"inv_freq": getattr(rot, f"{layer_type}_inv_freq").tolist(),
                 "scaling": getattr(rot, f"{layer_type}_attention_scaling")}
        mtp_cos, mtp_sin = rope_rows(table, 511)
        np.testing.assert_array_equal(mtp_cos[0], host_cos[3])
        np.testing.assert_array_equal(mtp_sin[0], host_sin[3])
        scales[layer_type] = rope.scaling[layer_type]
    assert (rope.inv_freq["full_attention"] == 0).mean() == pytest.approx(0.75)  # partial rotary
    expected = 1 + 0.1 * np.log(4.0) if sliding["rope_type"] == "yarn" else 1.0
    assert scales == pytest.approx({"full_attention": 1.0, "sliding_attention": expected})
