"""Write the qai-hub exchanges that tests/test_hub.py replays (see README.md).

No network reaches this machine, so these are not captures of a live session: every request and
response is built here from qai_hub's own protobuf classes (`qai_hub.public_api_pb2`) and stored as
protobuf text, in the order and at the URLs qai_hub 0.56 uses. The requests are what
`hyco-convert export --hub` must send, written down from the issue (device, options, input
specs), not copied from what export/hub.py happens to send.

    .venv/bin/python tests/data/qai_hub/make_recordings.py
"""

from __future__ import annotations

from pathlib import Path

import yaml
from google.protobuf import text_format
from qai_hub import public_api_pb2 as pb

HERE = Path(__file__).parent
API = "https://hub.replay.invalid"
S3 = "https://s3.replay.invalid"
CLIENT = {"api_url": API, "web_url": "https://workbench.replay.invalid", "api_token": "replay-token-0123"}
DEVICE = "Samsung Galaxy S26 Ultra"
OPTIONS = "--target_runtime qnn_context_binary --compute_unit npu"
# export.slm_graphs shared: tree and prefill compile to DLCs (their graph named by role in the linked
# context, as qai_hub_models names an LLM's graphs) and one link job joins them
DLC_OPTIONS = {role: f"--target_runtime qnn_dlc --compute_unit npu --qnn_options context_enable_graphs={role}"
               for role in ("tree", "prefill")}
# the calibrate folder the exchanges expect: per graph, its io_spec inputs (rows differ per graph)
CALIBRATE = {role: {"file": f"{role}.qdq.onnx", "rows": rows,
                    "inputs": {"embeds": [[rows, 8], "float32"], "mask": [[rows, rows], "uint16"]}}
             for role, rows in (("tree", 5), ("prefill", 3), ("mtp_step", 1))}
# attributes in qai-hub's catalogue style ("soc-model:N", "hexagon:vN", as qai_hub_models reads them);
# the values for this phone are the recipe's SoC (platform.md: soc_model 87 = SM8850, Hexagon v81)
ATTRIBUTES = ["chipset:qualcomm-snapdragon-8-elite-gen5", "format:phone", "framework:onnx", "framework:qnn",
              "framework:tflite", "hexagon:v81", "htp-supports-fp16:true", "htp-supports-weight-sharing:true",
              "os:android", "soc-model:87",
              "vendor:samsung"]
DTYPES = {"float32": pb.TENSOR_DTYPE_FLOAT32, "uint16": pb.TENSOR_DTYPE_UINT16}


def proto(message) -> dict:
    return {"message": type(message).__name__, "proto": text_format.MessageToString(message)}


def api(method: str, path: str, query: dict | None = None, body=None) -> dict:
    request = {"method": method, "url": f"{API}/api/v1/{path}/"}
    if query:
        request["query"] = query
    if body is not None:
        request.update(proto(body))
    return request


def answer(message=None, status: int = 200, **raw) -> dict:
    return {"status": status, **(proto(message) if message is not None else {}), **raw}


def device(attributes: list[str], described: bool = True) -> pb.Device:
    """The catalogue's device; the client sends it back in job requests without the description."""
    return pb.Device(name=DEVICE, os="16", attributes=attributes,
                     soc_description="Snapdragon 8 Elite Gen 5 | SM8850" if described else "")


def devices_lookup(attributes: list[str], select: str) -> dict:
    query = {"name": DEVICE, "os": "", "select": select}
    return {"request": api("GET", "devices", query), "response": answer(pb.DeviceList(devices=[device(attributes)],
                                                                                       total_query_count=1))}


def job_pb(job_id: str, state: int, role: str, *, compile_: bool, reason: str = "", dlc: bool = False,
           options: str = "") -> pb.Job:
    if compile_:
        target = pb.Model(model_id=f"mdl-{role}-dlc", name=f"{role}.dlc", producer_id=job_id,
                          model_type=pb.MODEL_TYPE_QNN_DLC) if dlc else \
            pb.Model(model_id=f"mdl-{role}-qnn", name=f"{role}.bin", producer_id=job_id,
                     model_type=pb.MODEL_TYPE_QNN_CONTEXT_BINARY)
        return pb.Job(compile_job=pb.CompileJob(compile_job_id=job_id, job_state=state, name=f"hyco-{role}",
                                                options=DLC_OPTIONS[role] if dlc else OPTIONS, target_model=target,
                                                failure_reason=reason))
    return pb.Job(inference_job=pb.InferenceJob(inference_job_id=job_id, job_state=state, name=f"hyco-{role}",
                                                is_profiling_on=True, options=options))


def compile_exchanges(role: str, attributes: list[str], *, fail: str = "", dlc: bool = False) -> list[dict]:
    spec = CALIBRATE[role]
    model, job = f"mdl-{role}", f"jc-{role}"
    options = DLC_OPTIONS[role] if dlc else OPTIONS
    tensors = pb.NamedTensorTypeList(types=[
        pb.NamedTensorType(name=n, tensor_type=pb.TensorType(shape=shape, dtype=DTYPES[dtype]))
        for n, (shape, dtype) in spec["inputs"].items()])
    request = pb.Job(compile_job=pb.CompileJob(
        model=pb.Model(model_id=model), name=f"hyco-{role}", options=options, tensor_type_list=tensors,
        devices=pb.DeviceList(devices=[device(attributes, described=False)], total_query_count=1)))
    folder = spec["file"]  # qai-hub's ONNX-with-external-weights form: a folder of the graph and its .data
    upload_url = f"{S3}/upload/{model}"
    done = pb.JOB_STATE_FAILED if fail else pb.JOB_STATE_DONE
    return [
        devices_lookup(attributes, "True"),
        {"request": api("POST", "models", body=pb.Model(name=folder, model_type=pb.MODEL_TYPE_ONNX,
                                                        is_directory=True)),
         "response": answer(pb.CreateUpdateResponse(id=model))},
        {"request": api("GET", f"models/{model}/multipart_upload",
                        {"use_acceleration": "true", "supports_s3_credentials": "true", "file_size": "*"}),
         "response": answer(pb.FileUploadResponse(multipart_url=pb.FileMultipartUploadURL(
             urls=[upload_url], upload_id=f"up-{role}", max_part_size=1 << 30)))},
        {"request": {"method": "PUT", "url": upload_url,
                     "zip": [f"{folder}/", f"{folder}/{folder}", f"{folder}/{folder}.data"]},
         "response": answer(headers={"ETag": f'"etag-{role}"'})},
        {"request": api("POST", f"models/{model}/multipart_upload",
                        body=pb.FileMultipartUploadComplete(upload_id=f"up-{role}", etags=[f'"etag-{role}"'])),
         "response": answer(pb.CreateUpdateResponse(id=model))},
        {"request": api("POST", "jobs", {"seed_target_model": "true"}, request),
         "response": answer(pb.CreateUpdateResponse(id=job))},
        {"request": api("GET", f"jobs/{job}"),
         "response": answer(job_pb(job, pb.JOB_STATE_CREATED, role, compile_=True, dlc=dlc))},
        {"request": api("GET", f"jobs/{job}"),
         "response": answer(job_pb(job, done, role, compile_=True, reason=fail, dlc=dlc))},
    ]


def download_exchanges(target: str, filename: str, content: str) -> list[dict]:
    download_url = f"{S3}/download/{target}/{filename}"
    return [
        {"request": api("GET", f"models/{target}/download",
                        {"use_acceleration": "true", "supports_s3_credentials": "true"}),
         "response": answer(pb.FileDownloadResponse(url=pb.FileDownloadURL(url=download_url, filename=filename)))},
        {"request": {"method": "GET", "url": download_url}, "response": answer(content=content)},
    ]


def profile_exchanges(role: str, attributes: list[str], figures: dict, *, target: str = "",
                      options: str = "") -> list[dict]:
    """Download the compiled binary (unless `target` is a linked one, downloaded once) and profile."""
    job = f"jp-{role}"
    request = pb.Job(inference_job=pb.InferenceJob(model=pb.Model(model_id=target or f"mdl-{role}-qnn"),
                                                   name=f"hyco-{role}", device=device(attributes, described=False),
                                                   is_profiling_on=True, options=options))
    memory = pb.ProfileDetail.MemoryUsage(peak=pb.Range(lower=figures["peak"][0], upper=figures["peak"][1]),
                                          increase=pb.Range(lower=1 << 20, upper=2 << 20))
    detail = pb.ProfileDetail(major_version=1, minor_version=1, execution_time=figures["time_us"],
                              cold_load_time=figures["load_us"], execution_memory=memory,
                              layer_details=[pb.LayerDetail(name=f"{role}/node{i}", layer_type_name="MatMul",
                                                            compute_unit=pb.COMPUTE_UNIT_NPU) for i in range(2)])
    done = answer(job_pb(job, pb.JOB_STATE_DONE, role, compile_=False, options=options))
    download = [] if target else download_exchanges(f"mdl-{role}-qnn", f"{role}.bin",
                                                     f"QNN context binary stand-in for {role} (replay)\n")
    return [
        *download,
        devices_lookup(attributes, "True"),
        {"request": api("POST", "jobs", body=request), "response": answer(pb.CreateUpdateResponse(id=job))},
        {"request": api("GET", f"jobs/{job}"), "response": done},  # wait(): the status
        {"request": api("GET", f"jobs/{job}"), "response": done},  # wait(): the inference job's shapes
        {"request": api("GET", f"jobs/{job}"), "response": done},  # download_profile() waits again
        {"request": api("GET", f"jobs/{job}/result"),
         "response": answer(pb.JobResult(inference_job_result=pb.InferenceJobResult(inference_job_id=job,
                                                                                   detail=detail)))},
    ]


def link_exchanges(attributes: list[str], *, fail: str = "") -> list[dict]:
    """The hub's link job over the two DLCs: one context binary, graphs named tree and prefill."""
    job, target = "jl-slm", "mdl-slm-qnn"
    models = pb.ModelList(models=[pb.Model(model_id=f"mdl-{r}-dlc") for r in DLC_OPTIONS], total_query_count=2)
    request = pb.Job(link_job=pb.LinkJob(models=models, device=device(attributes, described=False), name="hyco-slm"))

    def state(s: int) -> dict:
        return answer(pb.Job(link_job=pb.LinkJob(
            link_job_id=job, job_state=s, name="hyco-slm", failure_reason=fail if s == pb.JOB_STATE_FAILED else "",
            target_model=pb.Model(model_id=target, name="slm.bin", producer_id=job,
                                  model_type=pb.MODEL_TYPE_QNN_CONTEXT_BINARY))))

    return [
        devices_lookup(attributes, "True"),
        {"request": api("POST", "jobs", {"seed_target_model": "true"}, request),
         "response": answer(pb.CreateUpdateResponse(id=job))},
        {"request": api("GET", f"jobs/{job}"), "response": state(pb.JOB_STATE_CREATED)},
        {"request": api("GET", f"jobs/{job}"), "response": state(pb.JOB_STATE_FAILED if fail else pb.JOB_STATE_DONE)},
    ]


FIGURES = {"tree": {"time_us": 4210, "load_us": 91000, "peak": [6 << 20, 7 << 20]},
           "prefill": {"time_us": 3890, "load_us": 88000, "peak": [6 << 20, 7 << 20]},
           "mtp_step": {"time_us": 730, "load_us": 21000, "peak": [2 << 20, 3 << 20]}}


class _Dumper(yaml.SafeDumper):
    pass


# protobuf text as a readable block; short lists (shapes, zip members) on one line
_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def write(name: str, what: str, exchanges: list[dict]) -> None:
    doc = {"what": what, "client": CLIENT, "device": DEVICE, "calibrate": CALIBRATE, "exchanges": exchanges}
    text = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=110, default_flow_style=None)
    (HERE / name).write_text(f"# written by make_recordings.py from qai_hub's message classes; see README.md\n{text}")


def main() -> None:
    lookup = {"request": api("GET", "devices", {"name": DEVICE, "os": "", "select": "False"}),
              "response": answer(pb.DeviceList(devices=[device(ATTRIBUTES)], total_query_count=1))}
    success = [lookup]
    for role in CALIBRATE:
        success += compile_exchanges(role, ATTRIBUTES) + profile_exchanges(role, ATTRIBUTES, FIGURES[role])
    write("compile_profile.yaml", "three graphs compiled and profiled on the phone", success)
    failed = [lookup, *compile_exchanges("tree", ATTRIBUTES, fail="QNN graph finalize failed: op Gather unsupported")]
    write("compile_failed.yaml", "the first compile job fails on the server", failed)
    linked = [lookup, *compile_exchanges("tree", ATTRIBUTES, dlc=True), *compile_exchanges("prefill", ATTRIBUTES, dlc=True),
              *compile_exchanges("mtp_step", ATTRIBUTES), *profile_exchanges("mtp_step", ATTRIBUTES, FIGURES["mtp_step"]),
              *link_exchanges(ATTRIBUTES),
              *download_exchanges("mdl-slm-qnn", "slm.bin", "QNN context binary stand-in for tree+prefill (replay)\n")]
    for role in DLC_OPTIONS:
        linked += profile_exchanges(role, ATTRIBUTES, FIGURES[role], target="mdl-slm-qnn",
                                    options=f"--qnn_options context_enable_graphs={role}")
    write("link_profile.yaml", "tree and prefill linked into one shared context, mtp_step compiled alone; "
          "each graph profiled", linked)
    link_failed = [lookup, *compile_exchanges("tree", ATTRIBUTES, dlc=True),
                   *compile_exchanges("prefill", ATTRIBUTES, dlc=True), *compile_exchanges("mtp_step", ATTRIBUTES),
                   *profile_exchanges("mtp_step", ATTRIBUTES, FIGURES["mtp_step"]),
                   *link_exchanges(ATTRIBUTES, fail="weights of the two graphs differ: cannot share")]
    write("link_failed.yaml", "the link job fails on the server: no download may follow", link_failed)
    unshared = [a for a in ATTRIBUTES if a != "htp-supports-weight-sharing:true"]
    no_sharing = {**lookup, "response": answer(pb.DeviceList(devices=[device(unshared)], total_query_count=1))}
    write("no_weight_sharing.yaml", "the named device does not advertise weight sharing", [no_sharing])
    other = [a.replace("soc-model:87", "soc-model:69").replace("hexagon:v81", "hexagon:v79") for a in ATTRIBUTES]
    wrong = {**lookup, "response": answer(pb.DeviceList(devices=[device(other)], total_query_count=1))}
    write("wrong_soc.yaml", "the named device is another SoC (SM8750, v79) than the recipe's", [wrong])


if __name__ == "__main__":
    main()
