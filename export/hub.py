"""`hyco-convert export --hub`: compile and profile calibrate's QDQ graphs on a real phone through
qai-hub ("Samsung Galaxy S26 Ultra" by default), download the compiled context binaries and
record the job links and profile figures in OUT/hub.json.

Needs a token (`QAI_HUB_API_TOKEN` or the client's ~/.qai_hub/client.ini); without one the
command says so in one line and exits 2. `compile_requests` (what is sent) and `collect`
(what is read back) are separate so they are tested without an account.
"""

from __future__ import annotations

import configparser
import os
from pathlib import Path
from typing import Any

from hyco.export.stage import GRAPHS

from hyco.artifacts import write_json
from hyco.errors import HycoError
from hyco.io_spec import read_io_spec
from hyco.recipe import ExportConfig

OPTIONS = "--target_runtime qnn_context_binary --compute_unit npu"


def hub_token() -> str | None:
    """The token qai-hub would use: the environment first, then the client's config file."""
    if os.environ.get("QAI_HUB_API_TOKEN"):
        return os.environ["QAI_HUB_API_TOKEN"]
    ini = Path(os.environ.get("QAIHUB_CLIENT_INI", Path.home() / ".qai_hub" / "client.ini"))
    if ini.is_file():
        parser = configparser.ConfigParser()
        parser.read(ini)
        for section in parser.sections():
            if parser[section].get("api_token"):
                return parser[section]["api_token"]
    return None


def compile_requests(calibrate: Path, config: ExportConfig) -> list[dict[str, Any]]:
    """One compile request per graph: the QDQ model, the device, its fixed input specs."""
    import qai_hub as hub

    specs = read_io_spec(Path(calibrate) / "io_spec.json")
    device = hub.Device(config.device)
    requests = []
    for role, name in GRAPHS.items():
        if name not in specs or not (Path(calibrate) / name).is_file():
            raise HycoError(f"{calibrate}: no {name} ({role} graph) in io_spec.json or on disk (run calibrate first)")
        requests.append({"role": role, "model": Path(calibrate) / name, "device": device, "name": f"hyco-{role}",
                         "input_specs": {t.name: (tuple(t.shape), t.dtype) for t in specs[name].inputs},
                         "options": OPTIONS})
    return requests


def collect(role: str, compile_job, profile_job, profile: dict[str, Any]) -> dict[str, Any]:
    """What the report keeps of one graph's jobs (qai-hub's profile JSON layout)."""
    summary = profile.get("execution_summary", {})
    return {"role": role, "compile_job": compile_job.url, "profile_job": profile_job.url,
            "estimated_inference_time_us": summary.get("estimated_inference_time"),
            "peak_memory_bytes": summary.get("inference_memory_peak_range"),
            "compute_units": sorted({d.get("compute_unit") for d in profile.get("execution_detail", [])} - {None})}


def hub_export(*, calibrate: Path, out: Path, config: ExportConfig, client=None) -> dict[str, Any]:
    import qai_hub as hub

    token = hub_token()
    if client is None and token is None:
        raise HycoError("export --hub needs a qai-hub API token: set QAI_HUB_API_TOKEN or run `qai-hub configure "
                        "--api_token TOKEN` (nothing was submitted)")
    client = client or hub.Client(config=hub.ClientConfig(api_token=token))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = []
    for r in compile_requests(calibrate, config):
        compile_job = client.submit_compile_job(model=str(r["model"]), device=r["device"], name=r["name"],
                                                input_specs=r["input_specs"], options=r["options"])
        target = compile_job.get_target_model()
        if target is None:
            raise HycoError(f"{r['model']}: qai-hub compile job {compile_job.url} failed")
        target.download(str(out / f"{r['role']}.bin"))
        profile_job = client.submit_profile_job(model=target, device=r["device"], name=r["name"])
        jobs.append(collect(r["role"], compile_job, profile_job, profile_job.download_profile()))
    result = {"device": config.device, "options": OPTIONS, "jobs": jobs,
              "note": "profile figures are the phone's own (qai-hub), unlike the simulator times of `smoke`"}
    write_json(out / "hub.json", result)
    return result
