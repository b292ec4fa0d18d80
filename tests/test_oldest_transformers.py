"""The proofs on the oldest transformers pyproject allows (5.24), beside the newest the default
install resolves to: convert's bit-exact and traced-parity proofs, qat's head parity, the RMSNorm
decomposition, the block-scale reader and the compat module, run by pytest in a second venv.

That venv holds transformers 5.24 alone and reads every other package from this one (a `.pth`
file adds this venv's site-packages after its own), so it costs one small wheel from pip's cache,
not a second install of torch. It is kept in .cache/ between runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OLDEST = "5.24.0"
PROOFS = [
    "tests/test_compat.py",
    "tests/test_gemma_quant.py",
    "tests/test_block_scales.py",
    "tests/test_convert.py::test_bitexact_all_true_with_every_bit_width",
    "tests/test_convert.py::test_parity_against_transformers",
    "tests/test_convert.py::test_traced_parity_catches_mutations",
    "tests/test_convert.py::test_traced_parity_requires_every_srq_rounding_of_transformers",
    "tests/test_convert.py::test_luts_bit_exact_to_transformers",
    "tests/test_convert.py::test_rmsnorm_decomposed_close_to_transformers",
    "tests/test_convert.py::test_rope_tables_match_transformers",
    "tests/test_qat.py::test_float_step_graph_matches_transformers",
    "tests/test_qat.py::test_quantsim_integer_weights_are_bit_exact",
    "tests/test_qat.py::test_graph_parity_in_report",
    "tests/test_qat.py::test_int4_initializers_equal_head_w4",
    "tests/test_published.py::test_transformers_reads_the_published_slm_with_its_towers",
]


def oldest_venv() -> Path:
    """.cache/venv-transformers-OLDEST/bin/python: transformers OLDEST over this venv's packages."""
    venv = ROOT / ".cache" / f"venv-transformers-{OLDEST}"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # the venv's own site-packages, by its layout: asked of its python with `-S`, sysconfig answers
    # the base interpreter's (site.py is what moves the prefix into a venv), and pip would install
    # into that
    own = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    own.mkdir(parents=True, exist_ok=True)
    if not (own / "transformers").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(own),
                        f"transformers=={OLDEST}"], check=True)
    main = sysconfig.get_paths()["purelib"]  # this run's venv, also where an earlier run's was elsewhere
    (own / "zz_hyco_main_venv.pth").write_text(f"import site; site.addsitedir({main!r})\n")
    return python


@pytest.mark.slow
def test_the_proofs_hold_on_the_oldest_allowed_transformers(tmp_path):
    python = oldest_venv()
    found = subprocess.run([str(python), "-c", "import transformers, torch; print(transformers.__version__, transformers.__file__)"],
                           capture_output=True, text=True)
    assert found.returncode == 0, found.stderr[-2000:]
    version, where = found.stdout.split()
    assert version == OLDEST and Path(where).is_relative_to(python.parents[1]), found.stdout  # its own, not the base's
    done = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-m", "not slow",
                           "--basetemp", str(tmp_path / "pytest"), *PROOFS],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    tail = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= 40 and "skipped" not in done.stdout.splitlines()[-1], tail
