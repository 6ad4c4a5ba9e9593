"""Direct calls into the CUDA runtime that torch has already loaded, for the host-staged copy
loop: an async copy or event through ctypes costs a few microseconds, a torch op with a stream
context about 30 us (on 2x H200, 4 chunk copies per 0.9 MB block through torch ops make a
128-token exchange take 600 us). Every call checks its status.

The libraries are loaded as `ctypes.PyDLL`, whose calls keep the GIL: these calls only queue
work and return in microseconds, and a call that drops the GIL must win it back from whatever
thread took it meanwhile (Ray's and NCCL's threads), which can cost more than the call."""

import ctypes

import torch

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)
_EVENT_DISABLE_TIMING = 2
_NOT_READY = 600  # cudaErrorNotReady


class CudaRuntime:
    def __init__(self):
        torch.cuda.init()
        self.lib = ctypes.PyDLL(_loaded_cudart())
        vp, size = ctypes.c_void_p, ctypes.c_size_t
        self.lib.cudaMemcpyAsync.argtypes = [vp, vp, size, ctypes.c_int, vp]
        self.lib.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        self.lib.cudaEventRecord.argtypes = [vp, vp]
        # The CPU-driven loop polls events in a spin: those polls drop the GIL (CDLL) so that
        # other threads run meanwhile.
        self._polling = ctypes.CDLL(_loaded_cudart())
        self._polling.cudaEventQuery.argtypes = [vp]
        self.lib.cudaStreamWaitEvent.argtypes = [vp, vp, ctypes.c_uint]
        self.lib.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_uint]
        self._free_events: list[ctypes.c_void_p] = []

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """dst <- src (same byte count, contiguous) on `stream`."""
        status = self.lib.cudaMemcpyAsync(
            dst.data_ptr(),
            src.data_ptr(),
            src.numel() * src.element_size(),
            _MEMCPY_DEFAULT,
            stream.cuda_stream,
        )
        _check(status, "cudaMemcpyAsync")

    def record(self, stream: torch.cuda.Stream) -> ctypes.c_void_p:
        event = self._free_events.pop() if self._free_events else self._new_event()
        _check(self.lib.cudaEventRecord(event, stream.cuda_stream), "cudaEventRecord")
        return event

    def order(self, first: torch.cuda.Stream, then: torch.cuda.Stream, event) -> None:
        """Work queued on `then` from now on waits for the work queued on `first` so far.
        `event` is the caller's own, reused on every call."""
        self.record_into(event, first)
        self.wait(then, event)

    def device_address(self, host_address: int) -> int:
        """The device's address of registered (page-locked) host memory."""
        device_ptr = ctypes.c_void_p()
        status = self.lib.cudaHostGetDevicePointer(ctypes.byref(device_ptr), host_address, 0)
        _check(status, "cudaHostGetDevicePointer")
        return device_ptr.value or 0

    def record_into(self, event, stream: torch.cuda.Stream) -> None:
        _check(self.lib.cudaEventRecord(event, stream.cuda_stream), "cudaEventRecord")

    def wait(self, stream: torch.cuda.Stream, event) -> None:
        """Work queued on `stream` from now on waits for the work `event` last recorded."""
        _check(self.lib.cudaStreamWaitEvent(stream.cuda_stream, event, 0), "cudaStreamWaitEvent")

    def new_event(self) -> ctypes.c_void_p:
        return self._new_event()

    def is_done(self, event: ctypes.c_void_p) -> bool:
        """True once the work before `event` finished; the event then returns to the pool."""
        status = self._polling.cudaEventQuery(event)
        if status == _NOT_READY:
            return False
        _check(status, "cudaEventQuery")
        self._free_events.append(event)
        return True

    def _new_event(self) -> ctypes.c_void_p:
        event = ctypes.c_void_p()
        status = self.lib.cudaEventCreateWithFlags(ctypes.byref(event), _EVENT_DISABLE_TIMING)
        _check(status, "cudaEventCreateWithFlags")
        return event


def _loaded_cudart() -> str:
    """Path of the libcudart that this process mapped (torch's own), so versions match."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcudart.so" in path:
                return path
    return "libcudart.so"


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with CUDA error {status}")


_WAIT_VALUE_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ


class StreamMemoryOps:
    """Waits and writes on 32-bit words of page-locked host memory, done by the GPU in stream
    order (CUDA driver API `cuStreamWaitValue32` / `cuStreamWriteValue32`). With them two GPUs
    hand chunks to each other through host memory with no CPU in the loop: a stream writes a flag
    after its copy (the write is fenced behind the copy), the other GPU's stream waits for it."""

    def __init__(self):
        torch.cuda.init()
        self.lib = ctypes.PyDLL("libcuda.so.1")
        self._wait = _first_symbol(self.lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        self._write = _first_symbol(self.lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        for fn in (self._wait, self._write):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]

    def wait_equal(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        """Work queued on `stream` after this waits until the word at `address` == value."""
        status = self._wait(stream.cuda_stream, address, value & 0xFFFFFFFF, _WAIT_VALUE_EQ)
        _check(status, "cuStreamWaitValue32")

    def write(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        """Once the work queued on `stream` before this is done, store `value` at `address`."""
        status = self._write(stream.cuda_stream, address, value & 0xFFFFFFFF, 0)
        _check(status, "cuStreamWriteValue32")


def _first_symbol(lib: ctypes.CDLL, *names: str):
    for name in names:
        if hasattr(lib, name):
            return getattr(lib, name)
    raise AttributeError(f"the CUDA driver has none of {names}")
