"""Where does the host-staged transport's ~100 us per copy come from? (GPU machine, one GPU)

On 2x H200 a CPU-driven host-staged exchange pays a ~170 us floor and moves only ~30 GB/s
per direction, which would fit a fixed cost of ~100 us per cudaMemcpyAsync: the behaviour of
pageable memory. This times single device-to-host and host-to-device copies into
  torch-pinned   torch.empty(pin_memory=True)             (cudaHostAlloc)
  shm-registered a /dev/shm file mapped with torch.from_file, cudaHostRegister(flags)  <- ours
  pageable       plain torch.empty
through the same ctypes path the transport uses, and prints what cudaPointerGetAttributes
reports for each buffer, so one short run says whether our registration takes effect.

    python benchmarks/comm_host_copy_probe.py
"""

import ctypes
import os
import time

import torch

from rayinfer.comm.cudart import CudaRuntime

SIZES = (64 << 10, 256 << 10, 4 << 20, 32 << 20)


class _Attributes(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", ctypes.c_void_p),
        ("hostPointer", ctypes.c_void_p),
    ]


def memory_type(rt: CudaRuntime, t: torch.Tensor) -> int:
    """cudaMemoryType: 0 unregistered, 1 host (pinned), 2 device, 3 managed."""
    attrs = _Attributes()
    rt.lib.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(t.data_ptr()))
    return attrs.type


def shm_buffer(num_bytes: int, flags: int) -> torch.Tensor:
    path = f"/dev/shm/rayinfer-copy-probe-{os.getpid()}-{flags}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.posix_fallocate(fd, 0, num_bytes)
    os.close(fd)
    buf = torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)
    os.unlink(path)
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), num_bytes, flags)
    print(f"cudaHostRegister(flags={flags}) -> {int(err)}")
    return buf


def time_copy(rt: CudaRuntime, dst, src, stream, iters: int = 20) -> float:
    """Median seconds of one copy, CPU issue to GPU completion."""
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        rt.copy_async(dst, src, stream)
        event = rt.record(stream)
        while not rt.is_done(event):
            pass
        samples.append(time.perf_counter() - start)
    return sorted(samples)[iters // 2]


def main() -> None:
    rt = CudaRuntime()
    stream = torch.cuda.Stream()
    n = max(SIZES)
    gpu = torch.ones(n, dtype=torch.uint8, device="cuda")
    hosts = {
        "torch-pinned": torch.empty(n, dtype=torch.uint8, pin_memory=True),
        "shm-registered": shm_buffer(n, 0),
        "shm-registered-portable": shm_buffer(n, 1),
        "pageable": torch.empty(n, dtype=torch.uint8),
    }
    print(
        "| buffer | memory type | "
        + " | ".join(f"D2H {s >> 10} KiB" for s in SIZES)
        + " | "
        + " | ".join(f"H2D {s >> 10} KiB" for s in SIZES)
        + " |"
    )
    for name, host in hosts.items():
        d2h = [time_copy(rt, host[:s], gpu[:s], stream) for s in SIZES]
        h2d = [time_copy(rt, gpu[:s], host[:s], stream) for s in SIZES]
        cells = [f"{t * 1e6:.0f} us ({s / t / 1e9:.1f} GB/s)" for t, s in zip(d2h + h2d, SIZES * 2)]
        print(f"| {name} | {memory_type(rt, host)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
