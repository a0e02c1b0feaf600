"""The one task runner: `python3 -m nox` runs every check, `python3 -m nox -s demo` the main job.

Each package is tested and type-checked in an environment that holds only that package, the
lower layers it declares, and the test tools, so an undeclared dependency fails here first.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # nox itself depends on tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent
PACKAGES = ROOT / "packages"
# The CPU build of this exact version is what tests, CI and the demo run on; packages
# themselves declare a range.
TORCH = "torch==2.13.0"
TEST_TOOLS = ("pytest>=8", "pytest-xdist>=3", "numpy", "tomli>=1.1; python_version < '3.11'")
TEST_HELPERS = "pp-testing"
# Optional extras a package's tests exercise (pp-train writes TensorBoard events, reads
# Hugging Face tokenizer files and converts checkpoints to and from safetensors files).
TEST_EXTRAS = {"pp-train": ("tensorboard>=2.14", "tokenizers>=0.13", "safetensors>=0.4")}
# The oracle pp-state's layouts are checked against, from the package registry. Importing its
# parallel_state on CPU needs only its declared numpy and packaging; its hierarchical
# (distributed-optimizer instance) groups need einops, an optional dependency of it.
MEGATRON_ORACLE = ("megatron-core==0.16.1", "einops~=0.8")
# The Hugging Face models docs/examples pipeline (hf_llama.py, hf_gpt2.py), a test-time oracle
# (of pp-train's Hugging Face export and import too: nox -s hf_oracle).
TRANSFORMERS = "transformers==5.25.0"
# Outside libraries a package's own tests check it against, and the variable that turns their
# skip into a failure: pp-train's Hugging Face export and import against transformers' GPT-2
# run in tests(pp-train) (`hf_oracle` runs them alone).
TEST_ORACLES = {"pp-train": ((TRANSFORMERS,), "PP_TRAIN_HF_ORACLE")}

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.error_on_external_run = True
nox.options.sessions = [
    "lint",
    "tests",
    "integration",
    "megatron_oracles",
    "examples",
]


def _pip_find_links() -> str:
    """pip's find-links setting (where a local torch wheel may lie), or ''."""
    if os.environ.get("PIP_FIND_LINKS"):
        return os.environ["PIP_FIND_LINKS"]
    try:
        found = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return found.stdout.strip() if found.returncode == 0 else ""


# uv ignores pip's configuration; hand it pip's find-links so it takes a local torch wheel
# instead of resolving the multi-GB CUDA build, and have it write .pyc files (torch imports
# twice as fast with them).
if "UV_FIND_LINKS" not in os.environ and (links := _pip_find_links()):
    os.environ["UV_FIND_LINKS"] = links
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")


@cache
def _metadata(dist: str) -> dict[str, object]:
    with open(PACKAGES / dist / "pyproject.toml", "rb") as handle:
        project: dict[str, object] = tomllib.load(handle)["project"]
    return project


def _import_name(dist: str) -> str:
    return dist.replace("-", "_")


def _sibling_requirements(dist: str) -> list[str]:
    """The pp-* distributions `dist` declares, directly."""
    requirements = _metadata(dist).get("dependencies", [])
    assert isinstance(requirements, list)
    names = []
    for requirement in requirements:
        name = str(requirement).split(";")[0]
        for separator in "<>=!~[ ":
            name = name.split(separator)[0]
        if name.startswith("pp-"):
            names.append(name)
    return names


def _with_lower_layers(dists: Iterable[str]) -> list[str]:
    """`dists` and every pp-* distribution they need, transitively, lowest first."""
    ordered: list[str] = []

    def visit(dist: str) -> None:
        if dist in ordered:
            return
        for lower in _sibling_requirements(dist):
            visit(lower)
        ordered.append(dist)

    for dist in dists:
        visit(dist)
    return ordered


ALL_PACKAGES = sorted(
    path.name for path in PACKAGES.iterdir() if (path / "pyproject.toml").is_file()
)
LIBRARIES = [dist for dist in ALL_PACKAGES if dist != TEST_HELPERS]


def torch_install_args(environ: Mapping[str, str]) -> list[str]:
    """The install arguments of the pinned torch: with ``PP_TORCH_INDEX_URL`` set, from that index.

    On a machine without a local torch wheel, pointing ``PP_TORCH_INDEX_URL`` at an index that
    serves torch's CPU build (see the README) keeps torch from resolving to the multi-GB CUDA
    build. The index is used for torch alone; everything else comes from the usual index.
    """
    index = environ.get("PP_TORCH_INDEX_URL", "").strip()
    return [TORCH, "--index-url", index] if index else []


def _install(session: nox.Session, dists: Iterable[str], *extra: str) -> None:
    """Install local packages (rebuilt every run, never editable) plus pinned torch and `extra`."""
    local = _with_lower_layers(dists)
    paths = [str(PACKAGES / dist) for dist in local]
    if torch_first := torch_install_args(os.environ):
        session.install(*torch_first)  # then the line below finds torch satisfied
    if session.venv_backend == "uv":
        rebuild = [flag for dist in local for flag in ("--reinstall-package", dist)]
        session.install(TORCH, *extra, *paths, *rebuild)
    else:
        session.install(TORCH, *extra, *paths)
        session.install("--no-deps", "--force-reinstall", *paths)


# A check session that passes leaves this record in its environment: a digest of the files it
# checked and of the environment itself. A later run that reuses the environment (-r, -R)
# skips the session while both are unchanged; PP_RERUN=1 runs it anyway.
PASSED_RECORD = "pp-passed.txt"
# Never inputs of a check: git's folder and what .gitignore leaves out; with the tools' caches
# (.mypy_cache, .import_linter_cache, ...), folders ending in _cache or .egg-info.
_NOT_INPUTS = frozenset({".git", ".nox", "__pycache__", "build", "dist"})
_NOT_INPUT_ENDINGS = ("_cache", ".egg-info")


def _files(top: Path) -> Iterator[Path]:
    """`top` if it is a file, else the files under it, sorted, without caches and build output."""
    if top.is_file():
        yield top
        return
    for folder, subfolders, names in os.walk(top):
        subfolders[:] = sorted(
            name
            for name in subfolders
            if name not in _NOT_INPUTS and not name.endswith(_NOT_INPUT_ENDINGS)
        )
        for name in sorted(names):
            if not name.endswith(".pyc") and (path := Path(folder) / name).is_file():
                yield path


def fingerprint(root: Path, inputs: Iterable[str], environment: Path) -> str:
    """A digest of the files under `inputs` (paths relative to `root`) and of a virtualenv.

    Files count by path and content. The environment counts by its interpreter (pyvenv.cfg),
    the names and versions of the distributions installed in it and, for pp-* ones, the
    hashes of the files their install recorded.
    """
    digest = hashlib.sha256()

    def add(name: str, content: bytes) -> None:
        digest.update(f"{name}\0{len(content)}\0".encode())
        digest.update(content)

    for top in inputs:
        for path in _files(root / top):
            add(path.relative_to(root).as_posix(), path.read_bytes())
    add("pyvenv.cfg", (environment / "pyvenv.cfg").read_bytes())
    sites = [*environment.glob("lib/python*/site-packages"), *environment.glob("Lib/site-packages")]
    for info in sorted(path for site in sites for path in site.glob("*.dist-info")):
        record = info / "RECORD"
        own = info.name.startswith("pp_") and record.is_file()
        add(info.name, record.read_bytes() if own else b"")
    return digest.hexdigest()


def passed_unchanged(
    record: Path, digest: str, environ: Mapping[str, str], posargs: Sequence[str]
) -> bool:
    """Whether `record` says the session passed with fingerprint `digest` and may be skipped.

    Never when ``PP_RERUN`` is 1 or arguments were given after ``--``.
    """
    rerun = environ.get("PP_RERUN", "").strip()
    if rerun not in ("", "0", "1"):
        raise ValueError(f"PP_RERUN must be 0 or 1 (1 runs every session), got {rerun!r}")
    if rerun == "1" or posargs or not record.is_file():
        return False
    return record.read_text().split(" ", 1)[0] == digest


@contextmanager
def _unless_passed(session: nox.Session, inputs: Sequence[str]) -> Iterator[None]:
    """Skips the session if it passed before on the same `inputs` and environment.

    Otherwise runs the body and, if it passes, records the fingerprint taken before it ran.
    """
    environment = Path(session.virtualenv.location)
    record = environment / PASSED_RECORD
    digest = fingerprint(ROOT, inputs, environment)
    if passed_unchanged(record, digest, os.environ, session.posargs):
        when = record.read_text().partition(" ")[2].strip() or "an unrecorded time"
        session.skip(f"unchanged since it passed at {when}; PP_RERUN=1 runs it again")
    record.unlink(missing_ok=True)
    yield
    record.write_text(f"{digest} {time.strftime('%Y-%m-%d %H:%M:%S')}\n")


def _package_inputs(package: str) -> list[str]:
    """What a package's checks read: its folder, its lower layers', pp-testing's, the settings."""
    packages = _with_lower_layers([package, TEST_HELPERS])
    return ["noxfile.py", "pyproject.toml", *(f"packages/{dist}" for dist in packages)]


# Sessions that read across the repository (docs, every package, the integration tests).
WHOLE_REPOSITORY = ["."]


# Ranks talk over loopback and use one thread each: they share the machine's cores.
TEST_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def test_workers(environ: Mapping[str, str], cpus: int | None) -> list[str]:
    """pytest-xdist's arguments: ``PP_TEST_WORKERS`` workers, else one per core, 2 to 4.

    Many tests wait (ranks starting, timeouts running out): two workers keep a 2-core
    machine busy, and four bound the processes a larger one starts at once (up to 8 ranks
    per test). ``PP_TEST_WORKERS=0`` runs the tests in the one pytest process.
    """
    given = environ.get("PP_TEST_WORKERS", "").strip()
    if given:
        if not given.isdigit():
            raise ValueError(f"PP_TEST_WORKERS must be a whole number (0 for none), got {given!r}")
        return ["-n", given]
    return ["-n", str(min(4, max(2, cpus or 1)))]


def _pytest(session: nox.Session, *arguments: str, env: Mapping[str, str] = TEST_ENV) -> None:
    """pytest over `arguments` in parallel workers; arguments after ``--`` come last."""
    workers = test_workers(os.environ, os.cpu_count())
    session.run("pytest", *workers, *arguments, *session.posargs, env=dict(env))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting."""
    session.install("ruff>=0.6")
    with _unless_passed(session, WHOLE_REPOSITORY):
        session.run("ruff", "check", ".")
        session.run("ruff", "format", "--check", ".")


MYPY = "mypy>=1.10"


# One mypy cache for every session: each package's environment holds the same torch, numpy and
# pp-* sources, and mypy takes a cached module only when its file's hash and mypy's version and
# options match, so the first session analyses torch's stubs (about 30 s of CPU) and the others
# reuse them.
MYPY_CACHE = ROOT / ".nox" / ".mypy_cache"


def _mypy(session: nox.Session, package: str) -> None:
    """mypy --strict over a package's source, tests and benchmarks (the shared cache)."""
    source = PACKAGES / package / "src" / _import_name(package)
    benchmarks = [str(path) for path in [PACKAGES / package / "benchmarks"] if path.is_dir()]
    session.run(
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "--cache-dir",
        str(MYPY_CACHE),
        str(source),
        str(PACKAGES / package / "tests"),
        *benchmarks,
    )


@nox.session
@nox.parametrize("package", [nox.param(dist, id=dist) for dist in ALL_PACKAGES])
def tests(session: nox.Session, package: str) -> None:
    """mypy --strict and a package's unit tests, with only that package and its lower layers.

    One environment serves both checks (building one costs more than mypy itself), and the
    package's outside oracles (`TEST_ORACLES`).
    """
    oracles, variable = TEST_ORACLES.get(package, ((), ""))
    _install(session, [package, TEST_HELPERS], *TEST_TOOLS, *TEST_EXTRAS.get(package, ()),
             *oracles, MYPY)  # fmt: skip
    # The ten slowest tests are listed, so the growth of the run shows where it comes from.
    with _unless_passed(session, _package_inputs(package)):
        _mypy(session, package)
        env = {**TEST_ENV, variable: "1"} if variable else TEST_ENV
        _pytest(session, str(PACKAGES / package / "tests"), "--durations=10", env=env)


@nox.session
@nox.parametrize("package", [nox.param(dist, id=dist) for dist in ALL_PACKAGES])
def mypy(session: nox.Session, package: str) -> None:
    """mypy --strict alone (the default run's `tests` sessions run it too)."""
    _install(session, [package, TEST_HELPERS], *TEST_TOOLS, *TEST_EXTRAS.get(package, ()), MYPY)
    with _unless_passed(session, _package_inputs(package)):
        _mypy(session, package)


# Each oracle: (package, test file, the variable that turns its skip into a failure).
MEGATRON_ORACLES = [
    # pp-state's rank layouts against megatron-core's own, every factorisation up to 64
    ("pp-state", "test_megatron_oracle.py", "PP_STATE_MEGATRON_ORACLE"),
    # pp_tensor.megatron against megatron-core's tensor_parallel: names, signatures, the
    # config's fields, and its layers and cross entropy run on the CPU
    ("pp-tensor", "test_megatron_oracle.py", "PP_TENSOR_MEGATRON_ORACLE"),
    # pp-train's indexed files and GPT samples against megatron-core's, token for token
    ("pp-train", "test_megatron_data_oracle.py", "PP_TRAIN_MEGATRON_ORACLE"),
]


@nox.session
def megatron_oracles(session: nox.Session) -> None:
    """pp-state, pp-tensor and pp-train against megatron-core from the package registry.

    One environment (pp-train and its lower layers, megatron-core) runs the three test files;
    each file's variable makes a megatron-core that will not import a failure.
    """
    _install(session, ["pp-train", TEST_HELPERS], *TEST_TOOLS, *MEGATRON_ORACLE)
    with _unless_passed(session, _package_inputs("pp-train")):
        tests = [str(PACKAGES / package / "tests" / name) for package, name, _ in MEGATRON_ORACLES]
        variables = {variable: "1" for _, _, variable in MEGATRON_ORACLES}
        _pytest(session, *tests, env={**TEST_ENV, **variables})


@nox.session
def hf_oracle(session: nox.Session) -> None:
    """pp-train's Hugging Face export and import against the transformers library's GPT-2.

    Alone: the default run's tests(pp-train) runs them too.
    """
    _install(session, ["pp-train", TEST_HELPERS], *TEST_TOOLS, *TEST_EXTRAS["pp-train"],
             TRANSFORMERS)  # fmt: skip
    with _unless_passed(session, _package_inputs("pp-train")):
        test = str(PACKAGES / "pp-train" / "tests" / "test_hf_transformers.py")
        _pytest(session, test, "--durations=10", env={**TEST_ENV, "PP_TRAIN_HF_ORACLE": "1"})


IMPORT_LINTER = "import-linter>=2.1"


def _lint_imports(session: nox.Session) -> None:
    session.run("lint-imports", "--config", str(ROOT / "pyproject.toml"))


@nox.session
def layers(session: nox.Session) -> None:
    """Import-linter's layer contract, and declared pp-* dependencies == imported ones.

    The default run's `integration` session runs both too.
    """
    _install(session, ALL_PACKAGES, IMPORT_LINTER, *TEST_TOOLS)
    with _unless_passed(session, WHOLE_REPOSITORY):
        _lint_imports(session)
        session.run("pytest", str(ROOT / "integration_tests" / "test_dependencies.py"))


@nox.session
def integration(session: nox.Session) -> None:
    """Import-linter's contracts, then the tests across packages, with the whole stack installed.

    (The contracts run here rather than in an environment of their own: `layers` alone.)
    """
    extras = (x for e in TEST_EXTRAS.values() for x in e)
    # Pillow draws the schedule-trace picture of docs/pp-schedules.md (docs/examples); nox lets
    # a test import this file to check its install settings.
    _install(session, ALL_PACKAGES, *TEST_TOOLS, *extras, "pillow", "nox", IMPORT_LINTER)
    # The >>> examples in docs/*.md and the package READMEs run as doctests, so the docs
    # cannot drift from the code.
    readmes = sorted(str(path) for path in PACKAGES.glob("*/README.md"))
    with _unless_passed(session, WHOLE_REPOSITORY):
        _lint_imports(session)
        _pytest(
            session,
            str(ROOT / "integration_tests"),
            str(ROOT / "docs"),
            *readmes,
            "--doctest-glob=*.md",
            "--durations=10",
            f"--ignore={ANY_MODEL}",  # the examples session runs it, with transformers
        )


ANY_MODEL = ROOT / "integration_tests" / "test_any_model.py"


@nox.session
def examples(session: nox.Session) -> None:
    """docs/examples' trainers of any model (nn.Sequential, Hugging Face Llama and GPT-2).

    Every schedule at pp 2 and dp 2 x pp 2 against the model trained whole in one process
    (through its own forward), and Llama at context parallelism 2 through pp-tensor's
    transformers attention; PP_HF_EXAMPLES=1 makes a missing transformers a failure.
    """
    own = ["pp-optim", "pp-schedules", "pp-tensor"]  # the layers the examples import
    _install(session, [*own, TEST_HELPERS], *TEST_TOOLS, TRANSFORMERS)
    inputs = [*(path for dist in own for path in _package_inputs(dist)), "docs/examples",
              "integration_tests/conftest.py", str(ANY_MODEL.relative_to(ROOT))]  # fmt: skip
    with _unless_passed(session, inputs):
        _pytest(session, str(ANY_MODEL), "--durations=10", env={**TEST_ENV, "PP_HF_EXAMPLES": "1"})


@nox.session
def reliability(session: nox.Session) -> None:
    """The reliability tier: every failure case (marked ``reliability``) of every test suite.

    Bad flags, bad library inputs, injected NaN/inf, killed ranks, kill -9 during saves,
    SIGTERM and exact resume; each asserts the error class and the values its message names.
    The same tests run in the default sessions; this one runs them alone.
    """
    extras = (x for e in TEST_EXTRAS.values() for x in e)
    _install(session, ALL_PACKAGES, *TEST_TOOLS, *extras, "pillow", "nox")
    suites = [str(PACKAGES / dist / "tests") for dist in ALL_PACKAGES]
    with _unless_passed(session, WHOLE_REPOSITORY):
        _pytest(session, *suites, str(ROOT / "integration_tests"), "-m", "reliability")


BENCHMARKS = [
    # (package, script, arguments, ranks)
    ("pp-comm", "p2p_overhead.py", [], 2),
    ("pp-comm", "p2p_overhead.py", ["--unbatched"], 2),
    ("pp-schedules", "schedules_vs_torch.py", [], 2),
    ("pp-schedules", "schedules_vs_torch.py", [], 4),
    ("pp-schedules", "schedules_vs_torch.py", [], 8),
    ("pp-schedules", "zero_bubble_vs_torch.py", [], 4),
    ("pp-schedules", "dualpipev_vs_torch.py", [], 2),
    ("pp-schedules", "dualpipev_vs_torch.py", [], 4),
    ("pp-schedules", "any_model_vs_torch.py", [], 2),
    ("pp-schedules", "planning_at_scale.py", [], 1),
    ("pp-optim", "grad_allreduce.py", [], 2),
    ("pp-optim", "distopt_bench.py", [], 2),
    ("pp-optim", "distopt_bench.py", [], 4),
    ("pp-tensor", "cp_attention.py", [], 2),
    ("pp-train", "memory_bench.py", [], 4),
    ("pp-train", "tp_bench.py", [], 4),
]


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: each prints a table of ratios measured side by side in one run."""
    # torch.distributed.pipelining needs numpy; any_model_vs_torch.py runs Hugging Face's Llama.
    _install(session, LIBRARIES, "numpy", TRANSFORMERS)
    for package, script, arguments, ranks in BENCHMARKS:
        session.run(
            "torchrun",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            str(PACKAGES / package / "benchmarks" / script),
            *arguments,
            *session.posargs,
            env=TEST_ENV,
        )


@nox.session
def bench_data(session: nox.Session) -> None:
    """Preprocessing MB/s (1 and 2 workers) and GPT samples/s against megatron-core's."""
    _install(session, ["pp-train"], *MEGATRON_ORACLE)
    session.run(
        "python",
        str(PACKAGES / "pp-train" / "benchmarks" / "data_bench.py"),
        *session.posargs,
        env=TEST_ENV,
    )


@nox.session
def bench_checkpoint(session: nox.Session) -> None:
    """Step time during an asynchronous torch_dist save beside a blocking save's stall."""
    _install(session, LIBRARIES, "numpy")
    session.run(
        "torchrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(PACKAGES / "pp-train" / "benchmarks" / "async_save.py"),
        *session.posargs,
        env=TEST_ENV,
    )


@nox.session
def soak(session: nox.Session) -> None:
    """The fault-injected soak (not in the default run): 1,000 steps of the GPT under torchrun.

    Kills, SIGTERMs and SIGSTOPs ranks, fills the checkpoint disk during a save and corrupts
    the newest checkpoint, at seeded random moments; prints a table of what each fault did.
    Arguments after ``--`` go to the script (``-- --seed 2 --faults kill,stop``).
    """
    _install(session, LIBRARIES)
    session.run(
        "python",
        str(PACKAGES / "pp-train" / "benchmarks" / "soak.py"),
        *session.posargs,
        env=TEST_ENV,
    )


@nox.session
def stop_matrix(session: nox.Session) -> None:
    """Every rank killed and stopped in turn at pp 2 x dp 2 and tp 2 x pp 2 x dp 2, quiet and
    under load: each report and exit line must name it (not in the default run, ~13 minutes;
    the default run takes three of its cases)."""
    extras = (x for e in TEST_EXTRAS.values() for x in e)
    _install(session, ALL_PACKAGES, *TEST_TOOLS, *extras)
    # One job at a time: a "quiet" case must not share the cores with another job.
    session.run(
        "pytest",
        str(ROOT / "integration_tests" / "test_stop_matrix.py"),
        "-s",
        *session.posargs,
        env={**TEST_ENV, "PP_STOP_MATRIX": "1"},
    )


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: the bundled GPT on 4 CPU processes under torchrun, stopped and resumed."""
    _install(session, LIBRARIES, "tensorboard>=2.14")
    checkpoints = Path(session.create_tmp()) / "demo-checkpoints"
    shutil.rmtree(checkpoints, ignore_errors=True)
    command = [
        "torchrun",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "pp_train",
        "--pipeline-model-parallel-size",
        "2",
        "--train-iters",
        "100",
        "--lr-warmup-iters",
        "10",
        "--save",
        str(checkpoints),
        "--load",
        str(checkpoints),
        *session.posargs,
    ]
    session.log("first run: stops at iteration 50 (--exit-interval) after saving a checkpoint")
    session.run(*command, "--exit-interval", "50", env=TEST_ENV)
    session.log("second run: the same command resumes from that checkpoint")
    session.run(*command, env=TEST_ENV)
