"""export --hub: the real qai_hub client, replayed over recorded HTTP exchanges.

`Replay` stands in for the network below `requests` (HTTPAdapter.send, the one door every qai_hub
call goes through: API calls, the model upload PUT, the compiled-model download). Each request
must be the next recorded one: method, URL, query, token, and a body equal to the recorded
protobuf message (or zip members for the upload); the answer is the recorded message,
serialized. The exchanges in tests/data/qai_hub/ were synthesized from qai_hub's own message
classes (no network here, see the README there); the live test runs only with a token.
"""

from __future__ import annotations

import difflib
import io
import json
import tempfile
import zipfile
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

# qai-hub is a declared dependency (pyproject): a missing client is an install error, not a skip.
import qai_hub as hub
import yaml

from hyco.base.errors import HycoError
from hyco.config.recipe import ExportConfig

DATA = Path(__file__).parent / "data" / "qai_hub"


class Replay:
    """The recorded exchanges of one qai-hub session, answered in order; anything else fails."""

    def __init__(self, name: str):
        self.doc = yaml.safe_load((DATA / name).read_text())
        self.exchanges, self.at, self.uploads = self.doc["exchanges"], 0, {}

    def send(self, adapter, request, **kwargs):
        from google.protobuf import text_format
        from qai_hub import public_api_pb2 as pb
        from urllib3 import HTTPResponse

        url = urlsplit(request.url)
        assert self.at < len(self.exchanges), f"unrecorded request after the last exchange: {request.method} {request.url}"
        want, answer = self.exchanges[self.at]["request"], self.exchanges[self.at]["response"]
        self.at += 1
        where = f"exchange {self.at} ({want['method']} {want['url']})"
        assert (request.method, f"{url.scheme}://{url.netloc}{url.path}") == (want["method"], want["url"]), \
            f"{where}: got {request.method} {request.url}"
        query = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        expected = want.get("query", {})
        assert query.keys() == expected.keys() and all(v in ("*", query[k]) for k, v in expected.items()), \
            f"{where}: query {query}, recorded {expected}"
        if request.url.startswith(self.doc["client"]["api_url"]):
            assert request.headers.get("Authorization") == f"token {self.doc['client']['api_token']}", where
        body = request.body.read() if hasattr(request.body, "read") else request.body
        if "message" in want:
            got = getattr(pb, want["message"])()
            got.ParseFromString(body or b"")
            recorded = text_format.Parse(want["proto"], getattr(pb, want["message"])())
            diff = difflib.unified_diff(str(recorded).splitlines(), str(got).splitlines(), "recorded", "sent", lineterm="")
            assert got == recorded, f"{where}: the body differs\n" + "\n".join(diff)
        if "zip" in want:
            self.uploads[request.url] = body
            assert zipfile.ZipFile(io.BytesIO(body)).namelist() == want["zip"], f"{where}: upload members"
        content = answer.get("content", "").encode()
        headers = dict(answer.get("headers", {}))
        if "message" in answer:
            content = text_format.Parse(answer["proto"], getattr(pb, answer["message"])()).SerializeToString()
            headers["Content-Type"] = "application/x-protobuf"
        headers["Content-Length"] = str(len(content))
        raw = HTTPResponse(body=io.BytesIO(content), headers=headers, status=answer["status"], preload_content=False)
        return adapter.build_response(request, raw)

    def assert_done(self):
        assert self.at == len(self.exchanges), f"only {self.at} of {len(self.exchanges)} recorded exchanges were sent"


@pytest.fixture
def no_token(tmp_path, monkeypatch):
    monkeypatch.delenv("QAI_HUB_API_TOKEN", raising=False)
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(tmp_path / "absent.ini"))
    monkeypatch.setenv("HOME", str(tmp_path))


@pytest.fixture
def replay(tmp_path, monkeypatch, no_token):
    """Start a replay: the client's config file names the recording's dummy API URL and token."""
    import requests

    def start(name: str) -> Replay:
        session = Replay(name)
        c = session.doc["client"]
        ini = tmp_path / "client.ini"
        ini.write_text(f"[api]\napi_token = {c['api_token']}\napi_url = {c['api_url']}\nweb_url = {c['web_url']}\n"
                       "verbose = false\n")
        monkeypatch.setenv("QAIHUB_CLIENT_INI", str(ini))
        monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", lambda adapter, request, **kw:
                            session.send(adapter, request, **kw))
        return session

    return start


def make_calibrate(folder: Path, recording: str) -> Path:
    """Tiny QDQ-stand-in graphs with their weights in `<graph>.data`, as calibrate writes them, and
    the io_spec.json the recording's compile requests were written from."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from hyco.npu.io_spec import GraphSpec, TensorSpec, write_io_spec

    folder.mkdir(parents=True, exist_ok=True)
    specs = []
    for role, g in yaml.safe_load((DATA / recording).read_text())["calibrate"].items():
        rows = g["rows"]
        weight = numpy_helper.from_array(np.random.default_rng(len(role)).standard_normal((8, 64)).astype(np.float32), "w")
        graph = helper.make_graph([helper.make_node("MatMul", ["embeds", "w"], ["logits"])], role,
                                  [helper.make_tensor_value_info("embeds", TensorProto.FLOAT, [rows, 8]),
                                   helper.make_tensor_value_info("mask", TensorProto.UINT16, [rows, rows])],
                                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [rows, 64])], [weight])
        onnx.save_model(helper.make_model(graph), str(folder / g["file"]), save_as_external_data=True,
                        location=g["file"] + ".data", size_threshold=0)
        specs.append(GraphSpec(g["file"], tuple(TensorSpec(n, tuple(s), d, n) for n, (s, d) in g["inputs"].items()),
                               (TensorSpec("logits", (rows, 64), "float32", "logits"),)))
    write_io_spec(folder / "io_spec.json", specs)
    return folder


def _export_hub(tmp_path, *extra):
    """`export --hub` as a user types it: calibrate's folder is all it reads. The recordings hold
    the tree, prefill and MTP graphs' jobs: separate SLM graphs unless `extra` says otherwise."""
    from hyco.pipeline.cli import main

    if "--slm-graphs" not in extra:
        extra = ("--slm-graphs", "separate", *extra)
    return main(["export", "--hub", "--calibrate", str(tmp_path / "calibrate"), "--out", str(tmp_path / "hub"), *extra])


def test_compile_requests_carry_device_options_and_input_specs(tmp_path):
    from hyco.export.hub import OPTIONS, compile_requests

    make_calibrate(tmp_path, "compile_profile.yaml")
    assert [r["role"] for r in compile_requests(tmp_path, ExportConfig())] == ["tree", "mtp_step"]  # tree-only
    requests = compile_requests(tmp_path, ExportConfig(device="Samsung Galaxy S26 Ultra", slm_graphs="separate"))
    assert [r["role"] for r in requests] == ["tree", "prefill", "mtp_step"]
    assert all(isinstance(r["device"], hub.Device) and r["device"].name == "Samsung Galaxy S26 Ultra" for r in requests)
    assert requests[0]["input_specs"] == {"embeds": ((5, 8), "float32"), "mask": ((5, 5), "uint16")}
    assert requests[2]["input_specs"]["mask"] == ((1, 1), "uint16")
    assert OPTIONS.split() == ["--target_runtime", "qnn_context_binary", "--compute_unit", "npu"]
    (tmp_path / "prefill.qdq.onnx").unlink()
    with pytest.raises(HycoError, match="no prefill.qdq.onnx"):
        compile_requests(tmp_path, ExportConfig(slm_graphs="separate"))


def test_hub_export_compiles_profiles_and_reports_through_the_real_client(tmp_path, replay, capsys, monkeypatch):
    system_tmp = tmp_path / "system-tmp"  # qai-hub's upload leaves temp files there unless redirected
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    session = replay("compile_profile.yaml")
    calibrate = make_calibrate(tmp_path / "calibrate", "compile_profile.yaml")
    assert _export_hub(tmp_path) == 0
    session.assert_done()
    assert "3 qai-hub jobs on 'Samsung Galaxy S26 Ultra'" in capsys.readouterr().out
    # the upload is the graph and its external weights, byte for byte (qai-hub's ONNX folder form)
    tree_zip = zipfile.ZipFile(io.BytesIO(session.uploads["https://s3.replay.invalid/upload/mdl-tree"]))
    for name in ("tree.qdq.onnx", "tree.qdq.onnx.data"):
        assert tree_zip.read(f"tree.qdq.onnx/{name}") == (calibrate / name).read_bytes(), name
    out = tmp_path / "hub"
    report = json.loads((out / "hub.json").read_text())
    assert "soc-model:87" in report["device_attributes"] and report["options"].startswith("--target_runtime")
    jobs = {j["role"]: j for j in report["jobs"]}
    assert list(jobs) == ["tree", "prefill", "mtp_step"]
    assert jobs["tree"]["compile_job"] == "https://workbench.replay.invalid/jobs/jc-tree/"
    assert jobs["mtp_step"]["profile_job"] == "https://workbench.replay.invalid/jobs/jp-mtp_step/"
    assert [jobs[r]["estimated_inference_time_us"] for r in jobs] == [4210, 3890, 730]
    assert jobs["prefill"]["first_load_time_us"] == 88000
    assert jobs["mtp_step"]["peak_memory_bytes"] == [2 << 20, 3 << 20] and jobs["tree"]["compute_units"] == ["NPU"]
    for role in jobs:
        assert (out / f"{role}.bin").read_text() == f"QNN context binary stand-in for {role} (replay)\n"
        assert jobs[role]["binary"] == f"{role}.bin" and jobs[role]["binary_bytes"] == (out / f"{role}.bin").stat().st_size
    summary = (out / "hub.md").read_text()
    assert "https://workbench.replay.invalid/jobs/jp-prefill/" in summary and "| 730 |" in summary
    assert sorted(p.name for p in out.iterdir()) == ["hub.json", "hub.md", "mtp_step.bin", "prefill.bin", "tree.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibrate", "client.ini", "hub", "system-tmp"]
    assert list(system_tmp.iterdir()) == []  # no temp folder or file left, ours or qai-hub's


def test_shared_contexts_link_tree_and_prefill_into_one_binary_and_profile_each_graph(tmp_path, replay, capsys,
                                                                                       monkeypatch):
    """export.slm_graphs shared: tree and prefill compile to DLCs named by role, one link job joins them
    into one context binary (one copy of their weights, on the hub's side), and each graph is
    profiled from it by name; mtp_step compiles alone as before."""
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    session = replay("link_profile.yaml")
    make_calibrate(tmp_path / "calibrate", "link_profile.yaml")
    assert _export_hub(tmp_path, "--slm-graphs", "shared") == 0
    session.assert_done()
    assert "3 qai-hub jobs" in capsys.readouterr().out
    out = tmp_path / "hub"
    report = json.loads((out / "hub.json").read_text())
    jobs = {j["role"]: j for j in report["jobs"]}
    assert list(jobs) == ["tree", "prefill", "mtp_step"]
    shared = report["shared_context"]
    assert shared["graphs"] == ["tree", "prefill"] and shared["binary"] == "slm.bin"
    assert shared["link_job"] == "https://workbench.replay.invalid/jobs/jl-slm/"
    assert shared["binary_bytes"] == (out / "slm.bin").stat().st_size
    assert all("--target_runtime qnn_dlc" in o for o in shared["compile_options"].values())
    for role in ("tree", "prefill"):
        assert jobs[role]["binary"] == "slm.bin" and jobs[role]["link_job"] == shared["link_job"]
        assert jobs[role]["profile_job"] == f"https://workbench.replay.invalid/jobs/jp-{role}/"
    assert [jobs[r]["estimated_inference_time_us"] for r in jobs] == [4210, 3890, 730]
    assert jobs["mtp_step"]["binary"] == "mtp_step.bin" and "link_job" not in jobs["mtp_step"]
    assert sorted(p.name for p in out.iterdir()) == ["hub.json", "hub.md", "mtp_step.bin", "slm.bin"]
    assert "tree and prefill share one context binary, slm.bin" in (out / "hub.md").read_text()
    assert list(system_tmp.iterdir()) == []


def test_a_failed_link_job_is_one_line_exit_2_and_nothing_is_written(tmp_path, replay, capsys):
    session = replay("link_failed.yaml")
    make_calibrate(tmp_path / "calibrate", "link_failed.yaml")
    assert _export_hub(tmp_path, "--slm-graphs", "shared") == 2
    session.assert_done()  # no download of a linked binary: it is not in the recording
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "qai-hub link job https://workbench.replay.invalid/jobs/jl-slm/ ended FAILED" in err[0]
    assert "cannot share" in err[0] and not (tmp_path / "hub").exists()


def test_shared_contexts_need_a_device_that_shares_weights(tmp_path, replay, capsys):
    session = replay("no_weight_sharing.yaml")
    make_calibrate(tmp_path / "calibrate", "compile_profile.yaml")
    assert _export_hub(tmp_path, "--slm-graphs", "shared") == 2
    session.assert_done()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not advertise htp-supports-weight-sharing:true" in err[0]
    assert not (tmp_path / "hub").exists()


def test_failed_compile_job_is_one_line_exit_2_and_nothing_is_written(tmp_path, replay, capsys):
    session = replay("compile_failed.yaml")
    make_calibrate(tmp_path / "calibrate", "compile_failed.yaml")
    assert _export_hub(tmp_path) == 2
    session.assert_done()  # and no download was attempted: it is not in the recording
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "tree.qdq.onnx: qai-hub compile job https://workbench.replay.invalid/jobs/jc-tree/ ended FAILED" in err[0]
    assert "op Gather unsupported" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibrate", "client.ini"]


def test_a_device_of_another_soc_is_refused_before_any_upload(tmp_path, replay, capsys):
    session = replay("wrong_soc.yaml")
    make_calibrate(tmp_path / "calibrate", "compile_profile.yaml")
    assert _export_hub(tmp_path) == 2
    session.assert_done()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'hexagon:v79', 'soc-model:69'" in err[0] and "not soc_model 87 (SM8850, v81)" in err[0]
    assert not (tmp_path / "hub").exists()


@pytest.mark.parametrize("change", ["device", "options", "input spec"])
def test_the_replay_refuses_a_request_that_differs_from_the_recording(tmp_path, replay, monkeypatch, change):
    """The request checks bite: one changed field and the session stops at that exchange."""
    import hyco.export.hub as hub_module

    session = replay("compile_profile.yaml")
    calibrate = make_calibrate(tmp_path / "calibrate", "compile_profile.yaml")
    config = ExportConfig(slm_graphs="separate")
    if change == "device":
        config = ExportConfig(device="Samsung Galaxy S25 Ultra", slm_graphs="separate")
    elif change == "options":
        monkeypatch.setattr(hub_module, "OPTIONS", "--target_runtime onnx --compute_unit npu")
    else:
        spec = json.loads((calibrate / "io_spec.json").read_text())
        spec["graphs"][0]["inputs"][1]["dtype"] = "uint8"
        (calibrate / "io_spec.json").write_text(json.dumps(spec))
    where = {"device": "exchange 1 ", "options": "exchange 7 ", "input spec": "exchange 7 "}[change]
    with pytest.raises(AssertionError, match=where):
        hub_module.hub_export(calibrate=calibrate, out=tmp_path / "hub", config=config)
    assert session.at == int(where.split()[1]) and not (tmp_path / "hub").exists()


def test_without_token_one_line_exit_2_and_nothing_sent(tmp_path, no_token, monkeypatch, capsys):
    import requests

    def offline(adapter, request, **kw):
        raise AssertionError(f"sent without a token: {request.url}")

    monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", offline)
    make_calibrate(tmp_path / "calibrate", "compile_profile.yaml")
    assert _export_hub(tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "QAI_HUB_API_TOKEN" in err[0] and "nothing was submitted" in err[0]
    assert not (tmp_path / "hub").exists()


def test_an_out_folder_that_is_not_a_hub_output_is_refused_before_any_request(tmp_path, no_token, monkeypatch,
                                                                              capsys):
    import requests

    monkeypatch.setenv("QAI_HUB_API_TOKEN", "dummy")
    monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", lambda adapter, request, **kw: pytest.fail(request.url))
    make_calibrate(tmp_path / "calibrate", "compile_profile.yaml")
    (tmp_path / "hub" / "bundle").mkdir(parents=True)  # e.g. the offline export's folder
    assert _export_hub(tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not an earlier `export --hub` output" in err[0]
    assert (tmp_path / "hub" / "bundle").is_dir()


def test_hub_refuses_the_bundle_inputs_and_the_offline_export_requires_them(tmp_path, no_token, monkeypatch,
                                                                            capsys):
    """--hub reads only --calibrate, so --convert/--qat/--vocab are not required there (the replayed
    session above runs without them) and are refused rather than silently unused; the offline
    export needs them, and says which are missing before any work."""
    import requests

    from hyco.pipeline.cli import main

    monkeypatch.setenv("QAI_HUB_API_TOKEN", "dummy")
    monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", lambda adapter, request, **kw: pytest.fail(request.url))
    make_calibrate(tmp_path / "calibrate", "compile_profile.yaml")
    assert _export_hub(tmp_path, "--qat", str(tmp_path), "--verifier", str(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "export --hub reads only --calibrate" in err[0] and "--qat, --verifier" in err[0]
    assert _export_hub(tmp_path, "--htp-optimization-level", "1") == 2  # the hub compiles with its own settings
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--htp-optimization-level would not be used" in err[0]
    assert main(["export", "--calibrate", str(tmp_path / "calibrate"), "--qat", str(tmp_path),
                 "--out", str(tmp_path / "offline")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "export needs --convert, --vocab" in err[0]
    assert not (tmp_path / "hub").exists() and not (tmp_path / "offline").exists()


def test_token_from_the_environment_first_then_the_client_config(tmp_path, no_token, monkeypatch):
    from hyco.export.hub import hub_config

    assert hub_config() is None
    ini = tmp_path / "client.ini"
    ini.write_text("[api]\napi_token = from-ini\napi_url = https://hub.replay.invalid\nweb_url = https://w.invalid\n")
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(ini))
    assert (hub_config().api_token, hub_config().api_url) == ("from-ini", "https://hub.replay.invalid")
    monkeypatch.setenv("QAI_HUB_API_TOKEN", "from-env")
    assert hub_config().api_token == "from-env" and "qualcomm.com" in hub_config().api_url
    monkeypatch.delenv("QAI_HUB_API_TOKEN")
    ini.write_text("[api]\napi_token = no-url\n")
    with pytest.raises(HycoError, match="client.ini: not a qai-hub client config"):
        hub_config()


@pytest.mark.device
def test_hub_live_compile_and_profile(request, tmp_path):
    from hyco.export.hub import hub_config, hub_export

    if hub_config() is None:
        pytest.skip("no qai-hub API token (QAI_HUB_API_TOKEN or ~/.qai_hub/client.ini): live compile/profile on "
                    "Samsung Galaxy S26 Ultra not run")
    calibrated = request.getfixturevalue("tiny_calibrated")
    result = hub_export(calibrate=calibrated / "calibrate", out=tmp_path / "hub", config=ExportConfig())
    assert all(j["estimated_inference_time_us"] for j in result["jobs"])
