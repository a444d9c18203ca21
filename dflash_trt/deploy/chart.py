# SPDX-License-Identifier: Apache-2.0
"""The Helm chart seam: values from a bundle manifest, and offline lint/render/validation.

`dflash-trt build` calls `write_helm_values(bundle_dir, manifest)` (or
`helm_values_from_manifest`) so that every bundle carries the chart values it needs;
`dflash-trt chart --bundle DIR` lints and renders `helm/dflash-trt` with them.

Three independent checkers, none of which needs a cluster:
  * helm-python-sdk (the Helm v4 Go SDK through ctypes) or a real `helm` binary: lint and render;
  * `kubernetes-validate --strict`, run as its own CLI, with every WARN treated as a failure
    except "no schema" for the custom resources below;
  * jsonschema for those custom resources, against the project's schemas in `helm/schemas/`
    whose pod templates `$ref` the Kubernetes definitions of the version under test.

`helm lint` treats a template `fail` as a no-op (Helm's lint mode), so `lint_chart` also renders:
the chart's `validate-values.yaml` checks only fire on a render.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dflash_trt import __version__
from dflash_trt.errors import ConfigError, DFlashTrtError, EnvironmentMissing, UsageError

VALUES_FILE = "helm-values.yaml"
CHART_NAME = "dflash-trt"

DEFAULT_TRTLLM_IMAGE = ("nvcr.io/nvidia/tritonserver", "26.10-trtllm-python-py3")
# The serving image of build/docker/Dockerfile.serve-torch (`make image`); push it to your registry.
DEFAULT_TORCH_IMAGE = ("ghcr.io/dflash-trt/dflash-trt", f"{__version__}-cpu")
DEFAULT_MODEL_NAME = "tensorrt_llm"
DEFAULT_SSH_SECRET = "dflash-trt-ssh"

# GPUs per node when the manifest does not say: 8 (HGX/DGX), 4 on GB200/GB300 compute trays.
DEFAULT_GPUS_PER_NODE = 8
GPUS_PER_NODE_BY_PROFILE = {"gb200": 4, "gb300": 4}

BACKENDS = ("trtllm", "torch")

# The oldest and newest Kubernetes minor versions the chart is tested against.
DEFAULT_KUBE_VERSIONS = ("1.29.0", "1.33.0")

# Custom resources the chart can render -> the project's schema in helm/schemas/.
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring-v1.json",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset-leaderworkerset-v1.json",
}
K8S_DEFINITIONS_ID = "https://kubernetes.io/api/_definitions.json"


# --------------------------------------------------------------------------------------------
# Values from a manifest
# --------------------------------------------------------------------------------------------


def _section(manifest: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = manifest.get(key) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"manifest {key}", value, "must be a mapping", hint="re-run `dflash-trt build`")
    return value


def _int_field(section: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = section.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ConfigError(
            f"manifest {where}.{key}", value, "must be an integer", hint="re-run `dflash-trt build`"
        )
    if value < 0:
        raise ConfigError(f"manifest {where}.{key}", value, "must be >= 0", hint="re-run `dflash-trt build`")
    return int(value)


def _split_image(ref: str) -> dict[str, str]:
    """`repo[:tag][@sha256:...]` -> {repository, tag, digest}. A registry port is not a tag."""
    digest = ""
    if "@" in ref:
        ref, digest = ref.split("@", 1)
    repository, tag = ref, ""
    slash, colon = ref.rfind("/"), ref.rfind(":")
    if colon > slash:
        repository, tag = ref[:colon], ref[colon + 1 :]
    if not repository or (not tag and not digest):
        raise ConfigError(
            "manifest serving.image", ref, "needs a repository and a tag or digest", hint="e.g. repo/name:tag"
        )
    image = {"repository": repository, "tag": tag}
    if digest:
        image["digest"] = digest
    return image


def _gib(value: float) -> int:
    return max(1, math.ceil(value))


def _round_up(value: float, step: int) -> int:
    return int(math.ceil(value / step) * step)


def shm_size_gib(*, gpus_per_pod: int) -> int:
    """Memory-backed /dev/shm per pod.

    Triton's Python backend moves every request/response tensor through shared memory, and NCCL
    keeps its intra-node buffers there; 4 GiB per GPU (8..64 GiB) covers TP all-reduce rings
    with room for large batches. CPU pods only need the Python backend's share.
    """
    if gpus_per_pod == 0:
        return 1
    return min(64, max(8, 4 * gpus_per_pod))


def startup_budget_seconds(*, weights_gb: float, gpu: bool) -> int:
    """Default startup-probe budget when the manifest has none.

    20 s per GB is 50 MB/s, the slow end of network volumes; the 10 minutes on top cover
    process start, CUDA graph capture and warm-up. A 65 GB gpt-oss-120b gets 1900 s.
    CPU pods serve small models.
    """
    if not gpu:
        return max(300, _round_up(60 + 10 * weights_gb, 10))
    return _round_up(600 + 20 * weights_gb, 10)


def helm_values_from_manifest(
    manifest: Mapping[str, Any], *, build_args: Sequence[str] | None = None
) -> dict[str, Any]:
    """The chart values a bundle needs, derived from its `manifest.json` (schema_version 1).

    Only keys of `helm/dflash-trt/values.yaml` appear; everything else keeps the chart default.
    `build_args`, when given, turns on the init container in `build` mode with these
    `dflash-trt build` arguments (they must write the bundle to /models); otherwise the init
    container downloads the target and drafter by Hugging Face id when the manifest has them.
    """
    backend = manifest.get("backend")
    if backend not in BACKENDS:
        raise ConfigError(
            "manifest backend",
            backend,
            f"must be one of {', '.join(BACKENDS)}",
            hint="re-run `dflash-trt build`",
        )
    gpu, serving = _section(manifest, "gpu"), _section(manifest, "serving")
    sources = (_section(manifest, "target"), _section(manifest, "drafter"))
    layout = _gpu_layout(gpu, backend=backend)
    weights_gb = _weights_gb(serving)
    budget = _startup_budget(serving, weights_gb=weights_gb, gpu=layout.count > 0)
    shm = shm_size_gib(gpus_per_pod=layout.gpus_per_pod)
    values: dict[str, Any] = {
        "backend": backend,
        "image": _image(serving.get("image"), backend=backend),
        "bundle": {
            "name": str(manifest.get("name") or ""),
            "modelName": str(serving.get("model_name") or DEFAULT_MODEL_NAME),
        },
        "gpu": {"count": layout.count, "perNode": layout.per_node, "product": layout.product},
        "shm": {"sizeLimit": f"{shm}Gi"},
        "probes": {"startup": {"budgetSeconds": budget}},
    }
    # Storage: the weights in the Hugging Face cache, a quantized copy written by a build, and
    # the bundle itself; twice the weights plus 20 GiB, in steps of 10 GiB.
    values["storage"] = {"type": "newClaim", "size": f"{_round_up(2 * weights_gb + 20, 10)}Gi"}
    if layout.multi_node:
        values["storage"]["accessModes"] = ["ReadWriteMany"]
    model_init = _model_init(sources, build_args=build_args, gpu=layout.count > 0)
    if model_init is not None:
        values["modelInit"] = model_init
    if layout.multi_node:
        values["multiNode"] = {"enabled": True, "sshSecretName": DEFAULT_SSH_SECRET}
    values["resources"] = _resources(layout, weights_gb=weights_gb, shm_gib=shm)
    return values


@dataclass(frozen=True)
class _GpuLayout:
    count: int  # GPUs in all
    per_node: int
    product: list[str]  # the node label's GPU product, or [] (any)

    @property
    def multi_node(self) -> bool:
        return self.count > self.per_node

    @property
    def gpus_per_pod(self) -> int:
        return self.per_node if self.multi_node else self.count


def _gpu_layout(gpu: Mapping[str, Any], *, backend: str) -> _GpuLayout:
    """GPUs in all and per node from the manifest's `gpu` section (a multi-node count must fill nodes)."""
    count = _int_field(gpu, "count", "gpu", default=0)
    if backend == "trtllm" and count == 0:
        raise ConfigError(
            "manifest gpu.count",
            0,
            "backend=trtllm needs GPUs",
            hint="build for a GPU profile or backend=torch",
        )
    profile = str(gpu.get("profile") or "").lower()
    per_node_default = GPUS_PER_NODE_BY_PROFILE.get(profile, DEFAULT_GPUS_PER_NODE)
    per_node_key = "per_node" if "per_node" in gpu else "gpus_per_node"
    per_node = _int_field(gpu, per_node_key, "gpu", default=per_node_default)
    if per_node == 0:
        raise ConfigError(f"manifest gpu.{per_node_key}", 0, "must be >= 1", hint="GPUs per node, e.g. 8")
    if count > per_node and count % per_node:
        raise ConfigError(
            "manifest gpu.count",
            count,
            f"spans nodes but is not a multiple of {per_node} GPUs per node",
            hint=f"use a parallel size that is a multiple of {per_node}",
        )
    product = gpu.get("product_label")
    return _GpuLayout(count=count, per_node=per_node, product=[str(product)] if product and count > 0 else [])


def _weights_gb(serving: Mapping[str, Any]) -> float:
    raw = serving.get("weights_gb") or 0.0
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ConfigError(
            "manifest serving.weights_gb", raw, "must be a number", hint="re-run `dflash-trt build`"
        )
    if raw < 0:
        raise ConfigError(
            "manifest serving.weights_gb", float(raw), "must be >= 0", hint="re-run `dflash-trt build`"
        )
    return float(raw)


def _startup_budget(serving: Mapping[str, Any], *, weights_gb: float, gpu: bool) -> int:
    """The manifest's startup budget, else one estimated from the weights; at least 10 s."""
    budget = serving.get("startup_budget_s")
    if budget is None:
        budget = startup_budget_seconds(weights_gb=weights_gb, gpu=gpu)
    return max(_int_field({"startup_budget_s": budget}, "startup_budget_s", "serving"), 10)


def _image(ref: Any, *, backend: str) -> dict[str, str]:
    if ref:
        return _split_image(str(ref))
    repository, tag = DEFAULT_TRTLLM_IMAGE if backend == "trtllm" else DEFAULT_TORCH_IMAGE
    return {"repository": repository, "tag": tag}


def _model_init(
    sources: Sequence[Mapping[str, Any]], *, build_args: Sequence[str] | None, gpu: bool
) -> dict[str, Any] | None:
    """The init container: `build` with build_args, else `download` of the Hugging Face ids, else none."""
    if build_args:
        init: dict[str, Any] = {
            "enabled": True,
            "mode": "build",
            "build": {"args": [str(a) for a in build_args]},
        }
        if gpu:
            init["useGpus"] = True
        return init
    repos = [{"repo": str(s["hf_id"])} for s in sources if s.get("hf_id")]
    return {"enabled": True, "mode": "download", "download": {"repos": repos}} if repos else None


def _resources(layout: _GpuLayout, *, weights_gb: float, shm_gib: int) -> dict[str, Any]:
    if layout.count > 0:
        # No memory limit on GPU pods: staging weights through host memory peaks well above the
        # steady state, and an OOM kill there costs a full restart of the startup budget.
        memory = max(32, _gib(1.25 * weights_gb) + shm_gib)
        return {"requests": {"cpu": str(max(4, 4 * layout.gpus_per_pod)), "memory": f"{memory}Gi"}}
    memory = max(2, _gib(2 * weights_gb) + shm_gib)
    return {"requests": {"cpu": "2", "memory": f"{memory}Gi"}, "limits": {"memory": f"{2 * memory}Gi"}}


def write_helm_values(
    bundle_dir: Path, manifest: Mapping[str, Any], *, build_args: Sequence[str] | None = None
) -> Path:
    """Write `<bundle_dir>/helm-values.yaml` (atomically) and return its path."""
    from dflash_trt.utils.io import atomic_write_text, dump_yaml

    values = helm_values_from_manifest(manifest, build_args=build_args)
    header = (
        f"# Helm values for bundle {manifest.get('name', '?')!s}, written by dflash-trt {__version__}.\n"
        "# Use: dflash-trt chart --bundle <this dir> --lint --render -   or   helm install -f this file.\n"
    )
    path = Path(bundle_dir) / VALUES_FILE
    atomic_write_text(path, header + dump_yaml(values))
    return path


# --------------------------------------------------------------------------------------------
# Loading values
# --------------------------------------------------------------------------------------------


def default_chart_dir() -> Path:
    """The chart shipped inside the wheel (`dflash_trt/_chart/`), else `helm/dflash-trt` of the
    source tree this package runs from (editable installs)."""
    packaged = Path(__file__).resolve().parents[1] / "_chart" / CHART_NAME
    if (packaged / "Chart.yaml").is_file():
        return packaged
    return Path(__file__).resolve().parents[2] / "helm" / CHART_NAME


def default_schema_dir(chart_dir: Path | None = None) -> Path:
    return (chart_dir or default_chart_dir()).resolve().parent / "schemas"


def _read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise UsageError(f"{path}: cannot read {what}: {exc.strerror}", hint="check the path") from None
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0]
        raise UsageError(f"{path}: {what} is not valid YAML ({first})", hint="fix the YAML syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(
            f"{path}: {what} must be a YAML mapping, got {type(data).__name__}", hint="fix the file"
        )
    return data


def load_bundle_values(bundle_dir: Path) -> dict[str, Any]:
    """The values `dflash-trt build` wrote for this bundle."""
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / VALUES_FILE
    if not bundle_dir.is_dir():
        raise UsageError(
            f"--bundle {bundle_dir}: no such directory", hint="pass the directory `dflash-trt build` wrote"
        )
    if not path.is_file():
        raise UsageError(
            f"{path}: missing; the chart needs the bundle's Helm values",
            hint=f"re-run `dflash-trt build` for this bundle (it writes {VALUES_FILE}), or pass the right --bundle",
        )
    return _read_yaml_mapping(path, "Helm values")


def merge_values(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's coalescing for user values: maps merge, everything else (lists too) is replaced.

    An explicit null is kept, so that Helm itself drops the chart default for that key.
    """
    out: dict[str, Any] = {k: v for k, v in base.items()}
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_values(out[key], value)
        else:
            out[key] = value
    return out


def load_values(bundle_dir: Path, extra_files: Iterable[Path] = ()) -> dict[str, Any]:
    values = load_bundle_values(bundle_dir)
    for path in extra_files:
        values = merge_values(values, _read_yaml_mapping(Path(path), "values file"))
    return values


# --------------------------------------------------------------------------------------------
# Lint and render: helm-python-sdk or a helm binary
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LintReport:
    """`helm lint --strict` plus a render; `problems` is empty exactly when the chart passed."""

    tool: str
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True, slots=True)
class RenderedChart:
    """Rendered manifests as one multi-document YAML stream (`# Source:` comments as in helm)."""

    text: str
    notes: str | None = None
    documents: list[dict[str, Any]] = field(default_factory=list)


def _import_helm_python() -> Any:
    try:
        import helm_python
    except ImportError:
        raise EnvironmentMissing(
            "helm-python-sdk is not installed",
            hint="pip install 'dflash-trt[helm]', or pass --helm-binary PATH to use a helm executable",
        ) from None
    return helm_python


def _check_chart_dir(chart_dir: Path) -> Path:
    chart_dir = Path(chart_dir)
    if not (chart_dir / "Chart.yaml").is_file():
        raise UsageError(
            f"--chart {chart_dir}: no Chart.yaml there",
            hint="pass the helm/dflash-trt directory of a dflash-trt checkout with --chart (or DFLASH_TRT_CHART_DIR)",
        )
    return chart_dir


_HELM_PREAMBLES = (
    "in the following chart(s):",
    "invalid values for the dflash-trt chart:",
    "Use --debug flag to render out invalid YAML",
)


def _helm_message(text: str) -> str:
    """A helm error as one line: Helm's preambles and locations dropped, the items joined."""
    text = re.sub(r"execution error at \([^)]*\): ", "", text.removeprefix("Error: "))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.endswith(_HELM_PREAMBLES) and ln != f"{CHART_NAME}:"]
    return "; ".join(ln.removeprefix("- ") for ln in lines)


def _values_error(chart_dir: Path, message: str) -> UsageError:
    # The chart's own checks carry their fix; schema errors name the key and the constraint.
    hint = None if "fix:" in message else "correct the value at that path (see helm/dflash-trt/README.md)"
    return UsageError(f"values rejected by {chart_dir}: {message}", hint=hint)


@contextmanager
def _quiet_go_stderr() -> Iterator[None]:
    """Drop the Go SDK's own `funcMap fail` log lines (written straight to fd 2 in lint mode).

    The same failure is reported by the render that follows; other lines are passed on.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            for raw in sink.read().decode(errors="replace").splitlines():
                if "funcMap fail" not in raw:
                    sys.stderr.write(raw + "\n")


def _run_helm(helm_binary: Path, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [str(helm_binary), *args], capture_output=True, text=True, check=False, timeout=300
        )
    except OSError as exc:
        raise EnvironmentMissing(
            f"--helm-binary {helm_binary}: cannot run it ({exc.strerror})",
            hint="`make helm-bin` fetches .tools/helm/helm",
        ) from None


def _values_file(values: Mapping[str, Any], tmp: Path) -> Path:
    path = tmp / "values.yaml"
    path.write_text(yaml.safe_dump(dict(values), sort_keys=False))
    return path


def render_chart(
    values: Mapping[str, Any],
    *,
    chart_dir: Path | None = None,
    release: str = CHART_NAME,
    namespace: str = "default",
    helm_binary: Path | None = None,
    kube_version: str | None = None,
) -> RenderedChart:
    """`helm template`: with helm-python-sdk, or with the helm binary when one is given.

    Raises UsageError naming the offending key when the values break the schema or a
    `validate-values.yaml` check.
    """
    chart_dir = _check_chart_dir(chart_dir or default_chart_dir())
    if helm_binary is not None:
        with tempfile.TemporaryDirectory(prefix="dflash-trt-helm-") as tmp:
            args = ["template", release, str(chart_dir), "--namespace", namespace]
            args += ["-f", str(_values_file(values, Path(tmp)))]
            if kube_version:
                args += ["--kube-version", kube_version]
            proc = _run_helm(helm_binary, args)
        if proc.returncode != 0:
            raise _values_error(
                chart_dir, _helm_message(proc.stderr) or f"helm exited with {proc.returncode}"
            )
        return RenderedChart(text=proc.stdout, notes=None, documents=split_manifests(proc.stdout))

    helm_python = _import_helm_python()
    try:
        with helm_python.Chart.load(str(chart_dir)) as chart:
            rendered: dict[str, str] = chart.render(
                dict(values), name=release, namespace=namespace, is_install=True
            )
    except (helm_python.HelmValuesError, helm_python.HelmRenderError) as exc:
        raise _values_error(chart_dir, _helm_message(str(exc)) or type(exc).__name__) from None
    return rendered_from_sdk(rendered)


def rendered_from_sdk(rendered: Mapping[str, str]) -> RenderedChart:
    """helm-python-sdk's {template: text} as one stream; NOTES.txt and empty templates dropped."""
    parts: list[str] = []
    notes = None
    for name in sorted(rendered):
        text = rendered[name]
        if name.endswith("/NOTES.txt"):
            notes = text
            continue
        for doc in re.split(r"(?m)^---\s*$", text):
            if yaml.safe_load(doc) is None:  # comments or whitespace only
                continue
            parts.append(f"---\n# Source: {name}\n{doc.strip(chr(10))}\n")
    text = "".join(parts)
    return RenderedChart(text=text, notes=notes, documents=split_manifests(text))


def split_manifests(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def lint_chart(
    values: Mapping[str, Any],
    *,
    chart_dir: Path | None = None,
    helm_binary: Path | None = None,
    kube_version: str | None = None,
    namespace: str = "default",
) -> LintReport:
    """`helm lint --strict` with these values, plus a render (lint mode ignores `fail`)."""
    chart_dir = _check_chart_dir(chart_dir or default_chart_dir())
    problems: list[str] = []
    notes: list[str] = []
    if helm_binary is not None:
        tool = f"helm binary {helm_binary}"
        with tempfile.TemporaryDirectory(prefix="dflash-trt-helm-") as tmp:
            args = ["lint", "--strict", str(chart_dir), "--namespace", namespace]
            args += ["-f", str(_values_file(values, Path(tmp)))]
            if kube_version:
                args += ["--kube-version", kube_version]
            proc = _run_helm(helm_binary, args)
        for line in (proc.stdout + proc.stderr).splitlines():
            line = line.strip()
            if line.startswith("[INFO]"):
                notes.append(line.removeprefix("[INFO] "))
            elif line.startswith(("[WARNING]", "[ERROR]")) and not line.endswith(_HELM_PREAMBLES):
                level, _, rest = line.partition("] ")
                problems.append(
                    f"{rest.replace(': - at ', ': at ')}" + (" (warning)" if "WARNING" in level else "")
                )
        if proc.returncode != 0 and not problems:
            problems.append(
                f"helm lint exited with {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}"
            )
    else:
        helm_python = _import_helm_python()
        tool = f"helm-python-sdk (Helm {helm_python.helm_sdk_version()})"
        with _quiet_go_stderr():
            result = helm_python.lint(
                str(chart_dir), dict(values), strict=True, namespace=namespace, kube_version=kube_version
            )
        # Severity: 1 info, 2 warning, 3 error (Helm's support.Severity).
        for msg in result.get("messages", []):
            line = f"{msg.get('path', '')}: {_helm_message(str(msg.get('error', '')))}"
            (notes if int(msg.get("severity", 3)) <= 1 else problems).append(line)
        for err in result.get("errors", []):
            line = _helm_message(str(err))
            if not any(line in p for p in problems):
                problems.append(line)
    if not problems:
        try:
            render_chart(
                values,
                chart_dir=chart_dir,
                helm_binary=helm_binary,
                kube_version=kube_version,
                namespace=namespace,
            )
        except UsageError as exc:
            problems.append(exc.message)
    return LintReport(tool=tool, problems=tuple(problems), notes=tuple(notes))


# --------------------------------------------------------------------------------------------
# Manifest validation: kubernetes-validate --strict, plus our custom-resource schemas
# --------------------------------------------------------------------------------------------

_NO_SCHEMA = re.compile(
    r"Couldn't find schema for kind (\S+) with api version (\S+) for kubernetes version (\S+)"
)


def _k8s_definitions(version: str) -> dict[str, Any]:
    import importlib.util

    spec = importlib.util.find_spec("kubernetes_validate")
    if spec is None or not spec.submodule_search_locations:
        raise EnvironmentMissing(
            "kubernetes-validate is not installed", hint="pip install 'dflash-trt[helm]'"
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "kubernetes-json-schema"
    path = root / f"v{version}-local-strict" / "_definitions.json"
    if not path.is_file():
        raise UsageError(
            f"kube version {version}: kubernetes-validate has no strict schemas for it",
            hint="use a released minor such as 1.29.0 or 1.33.0",
        )
    defs: dict[str, Any] = json.loads(path.read_text())
    return defs


def _normalize_version(version: str) -> str:
    version = version.removeprefix("v")
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", version):
        raise UsageError(f"kube version {version!r}: not a Kubernetes version", hint="e.g. 1.29.0")
    return version if version.count(".") == 2 else f"{version}.0"


def _validate_custom_resources(
    documents: Sequence[Mapping[str, Any]], versions: Sequence[str], schema_dir: Path
) -> list[str]:
    import jsonschema
    from referencing import Registry, Resource

    problems: list[str] = []
    custom = [d for d in documents if (d.get("apiVersion"), d.get("kind")) in CRD_SCHEMAS]
    if not custom:
        return problems
    for version in versions:
        registry: Registry[Any] = Registry().with_resource(
            K8S_DEFINITIONS_ID, Resource.from_contents(_k8s_definitions(version))
        )
        for doc in custom:
            schema_file = schema_dir / CRD_SCHEMAS[(doc["apiVersion"], doc["kind"])]
            schema = json.loads(schema_file.read_text())
            validator = jsonschema.Draft202012Validator(schema, registry=registry)
            name = (doc.get("metadata") or {}).get("name", "?")
            for err in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
                where = ".".join(str(p) for p in err.absolute_path) or "<root>"
                problems.append(
                    f"{doc['kind']}/{name} against {schema_file.name} (k8s {version}): {where}: {err.message}"
                )
    return problems


def validate_manifests(
    text: str,
    *,
    kube_versions: Sequence[str] = DEFAULT_KUBE_VERSIONS,
    schema_dir: Path | None = None,
) -> list[str]:
    """Problems found in rendered manifests; an empty list means they validate.

    Runs the `kubernetes-validate --strict` CLI for every version and fails on every ERROR,
    FATAL and WARN line. The only WARN accepted is "no schema" for a custom resource listed in
    CRD_SCHEMAS, which is then validated against our own schema instead. A removed API
    (e.g. autoscaling/v2beta2) also comes back as "no schema" and fails.
    """
    versions = [_normalize_version(v) for v in kube_versions]
    schema_dir = schema_dir or default_schema_dir()
    documents = split_manifests(text)
    if not documents:
        return ["no Kubernetes objects in the rendered chart"]
    problems: list[str] = []
    custom_kinds = {(api, kind) for api, kind in CRD_SCHEMAS}
    with tempfile.TemporaryDirectory(prefix="dflash-trt-kv-") as tmp:
        path = Path(tmp) / "rendered.yaml"
        path.write_text(text)
        cmd = [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet"]
        for version in versions:
            cmd += ["-k", version]
        proc = subprocess.run([*cmd, str(path)], capture_output=True, text=True, check=False, timeout=300)
    for line in (proc.stdout + proc.stderr).splitlines():
        line = line.replace(str(path), "rendered.yaml").strip()
        if not line or line.startswith("INFO "):
            continue
        match = _NO_SCHEMA.search(line)
        if line.startswith("WARN ") and match and (match.group(2), match.group(1)) in custom_kinds:
            continue
        problems.append(line)
    if proc.returncode != 0 and not problems:
        problems.append(f"kubernetes-validate exited with {proc.returncode}")
    problems += _validate_custom_resources(documents, versions, schema_dir)
    return problems


def lint_failure(report: LintReport, *, values_source: str) -> DFlashTrtError:
    """The one-line error for a failed lint."""
    first = report.problems[0]
    more = f" (+{len(report.problems) - 1} more on stderr)" if len(report.problems) > 1 else ""
    hint = (
        None
        if "fix:" in first
        else "correct the values named above (helm/dflash-trt/README.md documents each)"
    )
    return DFlashTrtError(f"helm lint --strict failed with {values_source}: {first}{more}", hint=hint)
