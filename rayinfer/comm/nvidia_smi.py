"""What `nvidia-smi` says about the GPUs' links: the `topo -m` tree and `topo -p2p r` peer
access, restricted to the GPUs a group's ranks use. Everything returns None (or "") where
nvidia-smi is missing or says something unexpected: the probe's measurements stand alone."""

import shutil
import subprocess

import torch


def run(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return ""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def parse_gpu_matrix(text: str) -> dict[str, dict[str, str]]:
    """`nvidia-smi topo -m` or `topo -p2p r` -> {"GPU0": {"GPU1": "NV18", ...}, ...}
    (GPU rows and columns only)."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    header = lines[0].split() if lines else []
    gpus = [h for h in header if h.startswith("GPU")]
    links = {}
    for line in lines[1:]:
        cells = line.split()
        if cells and cells[0] in gpus:
            links[cells[0]] = dict(zip(gpus, cells[1 : 1 + len(gpus)], strict=False))
    return links


def is_fast_link(link: str) -> bool:
    """NVLink (NV#) or a single PCIe switch (PIX, PXB) between two GPUs."""
    return link.startswith("NV") or link in ("PIX", "PXB")


def my_gpu_index() -> int | None:
    """nvidia-smi's index of this process's current GPU (CUDA_VISIBLE_DEVICES renumbers)."""
    try:
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    except (AttributeError, RuntimeError):
        return None
    for line in run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"]).splitlines():
        index, _, smi_uuid = line.partition(",")
        if smi_uuid.strip().removeprefix("GPU-") == uuid.removeprefix("GPU-"):
            return int(index)
    return None


def links_between(gpu_indices: list[int]) -> tuple[tuple[str, ...], ...] | None:
    """[N][N] `topo -m` link names between the ranks' GPUs ("X" on the diagonal)."""
    return _restrict(parse_gpu_matrix(run(["nvidia-smi", "topo", "-m"])), gpu_indices)


def peer_access(gpu_indices: list[int]) -> tuple[tuple[bool, ...], ...] | None:
    """[N][N] whether GPU i can read GPU j directly (`topo -p2p r` says OK)."""
    table = _restrict(parse_gpu_matrix(run(["nvidia-smi", "topo", "-p2p", "r"])), gpu_indices)
    if table is None:
        return None
    return tuple(tuple(cell == "OK" for cell in row) for row in table)


def _restrict(table: dict[str, dict[str, str]], gpu_indices: list[int]):
    try:
        return tuple(tuple(table[f"GPU{i}"][f"GPU{j}"] for j in gpu_indices) for i in gpu_indices)
    except KeyError:
        return None
