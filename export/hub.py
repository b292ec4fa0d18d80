"""`hyco-convert export --hub`: compile and profile calibrate's QDQ graphs on a real phone through
qai-hub ("Samsung Galaxy S26 Ultra" by default), download the compiled context binaries and
record the job links and profile figures in OUT/hub.json and OUT/hub.md.

Needs a token: `QAI_HUB_API_TOKEN`, or the client's own config file (~/.qai_hub/client.ini or
`QAIHUB_CLIENT_INI`, which also names the API URL); without one the command says so in one line
and exits 2. The hub device must be the recipe's SoC (`soc-model:` and `hexagon:` attributes), so
the phone's binaries match the bundle's. OUT is written atomically: a failed job leaves nothing.

With `export.slm_graphs: shared`, tree and prefill carry the same weights, so they
are compiled to QNN DLCs and joined by the hub's link job into one context binary (slm.bin) with one
copy of the weights, as qai_hub_models links an LLM's prompt and token graphs; each graph is then
profiled from that binary (`--qnn_options context_enable_graphs=ROLE`). The device must advertise
`htp-supports-weight-sharing:true`.
"""

from __future__ import annotations

import configparser
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hyco.export.stage import _copy_graph

from hyco.base.errors import HycoError
from hyco.base.files import write_json
from hyco.config.recipe import ExportConfig, ships_prefill
from hyco.npu.io_spec import GRAPHS, read_io_spec
from hyco.pipeline.artifacts import atomic_dir, markdown_table
from hyco.qnn.contexts import soc_info

OPTIONS = "--target_runtime qnn_context_binary --compute_unit npu"
DLC_OPTIONS = "--target_runtime qnn_dlc --compute_unit npu"  # a link job's inputs
LINKED = ("tree", "prefill")  # the SLM graphs that share one context under export.slm_graphs shared
WEIGHT_SHARING = "htp-supports-weight-sharing:true"
NO_TOKEN = ("export --hub needs a qai-hub API token: set QAI_HUB_API_TOKEN or run `qai-hub configure --api_token "
            "TOKEN` (nothing was submitted)")


def hub_config():
    """The qai_hub.ClientConfig to use, or None without a token: the environment first, then the
    client's config file (read by the client itself, so its api_url and web_url count too)."""
    import qai_hub as hub
    from qai_hub.api_utils import get_config_path, load_api_config_from_file
    from qai_hub.public_rest_api import APIException

    if os.environ.get("QAI_HUB_API_TOKEN"):
        # verbose: the client shows upload/download bars and job status while it waits (minutes)
        return hub.ClientConfig(api_token=os.environ["QAI_HUB_API_TOKEN"], verbose=True)
    ini = get_config_path()
    if not os.path.isfile(ini):
        return None
    try:
        return load_api_config_from_file(ini)
    except (APIException, configparser.Error) as e:  # a missing [api] field, or not an ini at all
        raise HycoError(f"{ini}: not a qai-hub client config ({e})") from None


def compile_requests(calibrate: Path, config: ExportConfig) -> list[dict[str, Any]]:
    """One compile request per graph: the QDQ model, the device, its fixed input specs."""
    import qai_hub as hub

    specs = read_io_spec(Path(calibrate) / "io_spec.json")
    requests = []
    for role, name in GRAPHS.items():
        if role == "prefill" and not ships_prefill(config.slm_graphs):  # the tree graph prefills too
            continue
        if name not in specs or not (Path(calibrate) / name).is_file():
            raise HycoError(f"{calibrate}: no {name} ({role} graph) in io_spec.json or on disk (run calibrate first)")
        linked = config.slm_graphs == "shared" and role in LINKED
        # a linked graph's name in the shared context is its role, what the profile jobs select
        options = f"{DLC_OPTIONS} --qnn_options context_enable_graphs={role}" if linked else OPTIONS
        requests.append({"role": role, "model": Path(calibrate) / name, "device": hub.Device(config.device),
                         "name": f"hyco-{role}", "options": options, "linked": linked,
                         "input_specs": {t.name: (tuple(t.shape), t.dtype) for t in specs[name].inputs}})
    return requests


def check_device(client, config: ExportConfig) -> list[str]:
    """The hub device's attributes, refused unless it is the recipe's SoC and Hexagon arch."""
    chip, arch = soc_info(config.soc_model, config.htp_arch)
    devices = client.get_devices(name=config.device)
    if not devices:
        raise HycoError(f"qai-hub has no device named {config.device!r} (export.device)")
    attributes = sorted({a for d in devices for a in d.attributes})
    want = {f"soc-model:{config.soc_model}", f"hexagon:v{arch}"}
    if not want <= set(attributes):
        found = [a for a in attributes if a.startswith(("soc-model:", "hexagon:"))]
        raise HycoError(f"qai-hub device {config.device!r} is {found}, not soc_model {config.soc_model} ({chip}, "
                        f"v{arch}): set export.soc_model to the device's, or pick a {chip} device")
    if config.slm_graphs == "shared" and WEIGHT_SHARING not in attributes:
        raise HycoError(f"qai-hub device {config.device!r} does not advertise {WEIGHT_SHARING}: export.slm_graphs "
                        "shared needs it (set export.slm_graphs to tree-only, or pick a device that shares weights)")
    return attributes


def collect(role: str, compile_job, profile_job, profile: dict[str, Any]) -> dict[str, Any]:
    """What the report keeps of one graph's jobs (qai-hub's profile layout; times in microseconds)."""
    summary = profile.get("execution_summary", {})
    return {"role": role, "compile_job": compile_job.url, "profile_job": profile_job.url,
            "estimated_inference_time_us": summary.get("estimated_inference_time"),
            "first_load_time_us": summary.get("first_load_time"),
            "peak_memory_bytes": summary.get("inference_memory_peak_range"),
            "compute_units": sorted({d.get("compute_unit") for d in profile.get("execution_detail", [])} - {None})}


def _finished(job, what: str, model: Path) -> None:
    status = job.wait()
    if not status.success:
        raise HycoError(f"{model}: qai-hub {what} job {job.url} ended {status.code}: {status.message or 'no reason given'}")


@contextlib.contextmanager
def _temp_files_in(folder: Path) -> Iterator[None]:
    """qai-hub's upload writes a NamedTemporaryFile(delete=False) and a zip of the model folder
    into the system temp folder and leaves both there (more with every run of the replay
    tests): they go into `folder`, removed with it."""
    before = tempfile.tempdir
    tempfile.tempdir = str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = before


def _compile(client, r: dict[str, Any], tmp: Path):
    # qai-hub takes an ONNX model with external weights as a folder of the graph and its .data
    upload = tmp / "upload" / r["role"] / r["model"].name
    _copy_graph(r["model"], upload)
    with _temp_files_in(tmp / "upload"):  # removed once the jobs are done
        job = client.submit_compile_job(model=upload, device=r["device"], name=r["name"],
                                        input_specs=r["input_specs"], options=r["options"])
    _finished(job, "compile", r["model"])
    return job


def _profile(client, target, r: dict[str, Any], options: str = ""):
    job = client.submit_inference_job(model=target, device=r["device"], name=r["name"], profile=True,
                                      options=options)
    _finished(job, "profile", r["model"])
    return job


def _run_jobs(client, requests: list[dict[str, Any]], tmp: Path) -> tuple[list[dict[str, Any]], dict | None]:
    """Compile, download and profile each graph; the linked ones (export.slm_graphs shared) through
    one link job. Returns the graphs' rows and the shared context's (None without one)."""
    jobs, compiled = [], {}
    for r in requests:
        compile_job = _compile(client, r, tmp)
        if r["linked"]:
            compiled[r["role"]] = compile_job
            continue
        target = compile_job.get_target_model()
        binary = Path(target.download(str(tmp / f"{r['role']}.bin")))
        profile_job = _profile(client, target, r)
        jobs.append({**collect(r["role"], compile_job, profile_job, profile_job.download_profile()),
                     "binary": binary.name, "binary_bytes": binary.stat().st_size})
    if not compiled:
        return jobs, None
    linked = [r for r in requests if r["linked"]]
    link_job = client.submit_link_job(models=[compiled[r["role"]].get_target_model() for r in linked],
                                      device=linked[0]["device"], name="hyco-slm")
    _finished(link_job, "link", linked[0]["model"])
    target = link_job.get_target_model()
    binary = Path(target.download(str(tmp / "slm.bin")))
    for r in linked:
        profile_job = _profile(client, target, r, f"--qnn_options context_enable_graphs={r['role']}")
        jobs.append({**collect(r["role"], compiled[r["role"]], profile_job, profile_job.download_profile()),
                     "link_job": link_job.url, "binary": binary.name, "binary_bytes": binary.stat().st_size})
    order = [r["role"] for r in requests]
    shared = {"binary": binary.name, "binary_bytes": binary.stat().st_size, "graphs": [r["role"] for r in linked],
              "link_job": link_job.url, "compile_options": {r["role"]: r["options"] for r in linked}}
    return sorted(jobs, key=lambda j: order.index(j["role"])), shared


def hub_export(*, calibrate: Path, out: Path, config: ExportConfig) -> dict[str, Any]:
    import qai_hub as hub
    from qai_hub.public_rest_api import APIException

    hub_conf = hub_config()
    if hub_conf is None:
        raise HycoError(NO_TOKEN)
    out = Path(out)
    if out.is_dir() and any(out.iterdir()) and not (out / "hub.json").is_file():
        raise HycoError(f"{out}: not an earlier `export --hub` output, and --out is replaced whole: pick a new folder")
    requests = compile_requests(calibrate, config)
    client = hub.Client(config=hub_conf)
    with atomic_dir(out) as tmp:
        try:
            attributes = check_device(client, config)
            jobs, shared = _run_jobs(client, requests, tmp)
        except (hub.Error, APIException) as e:  # the client's own errors span lines; the CLI prints one
            raise HycoError(f"qai-hub: {' '.join(str(e).split())}") from None
        shutil.rmtree(tmp / "upload")
        result = {"device": config.device, "device_attributes": attributes,
                  "options": OPTIONS, "jobs": jobs, "shared_context": shared,
                  "note": "profile figures are the phone's own (qai-hub), unlike the simulator times of `smoke`"}
        write_json(tmp / "hub.json", result)
        linked = (f"{' and '.join(shared['graphs'])} share one context binary, {shared['binary']} "
                  f"({shared['binary_bytes']:,} bytes, link job {shared['link_job']}).\n\n") if shared else ""
        (tmp / "hub.md").write_text(f"# qai-hub compile + profile on {config.device}\n\n{result['note']}.\n\n{linked}"
                                   + markdown_table(jobs, ["role", "estimated_inference_time_us", "peak_memory_bytes",
                                                           "compute_units", "binary", "binary_bytes", "compile_job",
                                                           "profile_job"]))
    return result
