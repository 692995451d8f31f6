"""Running untrusted work (a checkpoint's chat template) with a time and memory bound.

jinja2's sandbox stops a template from reaching files or Python internals, but not from
looping for hours (nested loops, recursive macros) or building a gigabyte string
(`'x' * 10**10`, `'x'.center(10**10)`, a namespace doubling a string in a loop) in one
C call that no check between Python lines could interrupt; even compiling one can do
that, since jinja2 folds constant expressions.  No check on the template text can rule
all of these out, and what a render does depends on the messages too, so every render
runs in a child process: it gets an address-space limit of what the process maps when
it starts plus `max_bytes`, and is killed when one call runs past its time.

The child is long-lived (a Worker): forked once, it builds its state (a compiled
template) on its first call and answers call after call over a pipe, so that a request
pays a round trip of well under a millisecond instead of a fork (about 80 ms from a
process with torch loaded).  A call that overruns, runs out of memory or kills the
child ends that child; the next call forks a fresh one.  The child closes every file
descriptor it inherited but its two pipes (a server's sockets, a communicator's
segments, another Worker's pipes), ends with its parent (idle, by EOF on its pipe;
working, by a look at its parent process each second: not PR_SET_PDEATHSIG, which fires
when the forking thread ends, and a server forks from a pool thread), only runs Python code of this process's image, and leaves with os._exit, so
the threads it does not inherit (BLAS workers, a communicator's) are never waited for.
Requests and answers travel as JSON: the parent never unpickles what the child wrote.

Where fork is missing (not Linux or macOS) the work runs in-process, unbounded."""
import json
import os
import select
import signal
import struct
import threading
import time
import warnings
import weakref


class Overrun(Exception):
    """The work ran past its time or memory bound, or its process died."""


class Failed(Exception):
    """The work raised: .kind is the exception's class name, .text its message."""

    def __init__(self, kind, text):
        super().__init__(f"{kind}: {text}")
        self.kind, self.text = kind, text


_LEN = struct.Struct("<Q")


def _vm_bytes():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def _write_frame(fd, obj):
    data = json.dumps(obj).encode()
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd, n, deadline=None):
    """n bytes from fd, or None at EOF; raises TimeoutError past deadline (monotonic)."""
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _read_frame(fd, deadline=None):
    head = _read_exact(fd, _LEN.size, deadline)
    if head is None:
        return None
    body = _read_exact(fd, _LEN.unpack(head)[0], deadline)
    return None if body is None else json.loads(body)


def _child(setup, requests, answers, max_bytes, vm, parent):  # pragma: no cover (runs in the child)
    code = 0
    try:
        keep = sorted((requests, answers))
        os.closerange(3, keep[0])
        os.closerange(keep[0] + 1, keep[1])
        os.closerange(keep[1] + 1, 1 << 16)
        signal.setitimer(signal.ITIMER_REAL, 0)  # a timer of the parent's is not the child's

        def orphaned(_signum, _frame):
            if os.getppid() != parent:
                os._exit(0)
        signal.signal(signal.SIGALRM, orphaned)
        if vm is not None:
            import resource
            _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            limit = vm + max_bytes if hard == resource.RLIM_INFINITY else min(vm + max_bytes, hard)
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        handler = None
        while True:
            request = _read_frame(requests)
            if request is None:
                break  # the parent closed the pipe (or died)
            out_of_memory = False
            try:
                # while it works, a look each second for a parent that died (when idle, EOF says so)
                signal.setitimer(signal.ITIMER_REAL, 1.0, 1.0)
                if handler is None:
                    handler = setup()
                out = ["ok", handler(request)]
            except MemoryError:
                out, out_of_memory = ["memory"], True
            except BaseException as e:
                out = ["raised", type(e).__name__, str(e)[:4000]]
            signal.setitimer(signal.ITIMER_REAL, 0)
            try:
                _write_frame(answers, out)
            except MemoryError:
                out_of_memory = True
            if out_of_memory:
                break  # what a MemoryError left half-built: start the next call afresh
    except BaseException:
        code = 3
    finally:
        os._exit(code)


def _stop(pid, fds, owner):
    """Ends a child and closes its pipes (a Worker's finalizer: idempotent).  In a process
    forked from the owner (which inherited the Worker), only forgets them: the child is
    the owner's."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    if pid[0] and os.getpid() != owner:
        pid[0] = 0
    if pid[0]:
        try:
            os.kill(pid[0], signal.SIGKILL)
        except OSError:
            pass
        try:
            os.waitpid(pid[0], 0)
        except ChildProcessError:
            pass
        pid[0] = 0


class Worker:
    """A long-lived child process that answers call(request) with handler(request), where
    handler = setup() is built in the child on the first call (and rebuilt by a fresh
    child after an overrun).  Requests and answers are JSON values.  call() raises
    Failed when the handler (or setup) raised, Overrun when it ran out of time or
    memory or its process died.  Thread-safe (one call at a time); close() ends it, and
    so does dropping the last reference."""

    def __init__(self, setup, max_bytes=512 << 20):
        self._setup, self._max_bytes = setup, max_bytes
        self._lock = threading.Lock()
        self._pid, self._fds = [0], []  # shared with the finalizer
        self._owner = os.getpid()
        self._requests = self._answers = None
        self._handler = None  # in-process, where there is no fork
        self._finalizer = weakref.finalize(self, _stop, self._pid, self._fds, self._owner)

    @property
    def pid(self):
        """The child's process id, 0 when none runs now (tests, diagnostics)."""
        return self._pid[0]

    def _start(self):
        vm = _vm_bytes()
        req_r, req_w = os.pipe()
        ans_r, ans_w = os.pipe()
        parent = os.getpid()
        with warnings.catch_warnings():  # Python 3.12+ warns on fork with threads; see the docstring
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover
            _child(self._setup, req_r, ans_w, self._max_bytes, vm, parent)
        os.close(req_r)
        os.close(ans_w)
        self._pid[0] = pid
        self._fds[:] = [req_w, ans_r]
        self._requests, self._answers = req_w, ans_r

    def _end(self):
        _stop(self._pid, self._fds, self._owner)
        self._requests = self._answers = None

    def call(self, request, seconds=10.0):
        if not hasattr(os, "fork"):
            return self._call_here(request)
        with self._lock:
            if os.getpid() != self._owner:  # a forked copy of the owner: its own child, not the owner's
                self._end()
                self._owner = os.getpid()
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _stop, self._pid, self._fds, self._owner)
            if not self._pid[0]:
                self._start()
            try:
                _write_frame(self._requests, request)
                out = _read_frame(self._answers, time.monotonic() + seconds)
            except TimeoutError:
                self._end()
                raise Overrun(f"it did not finish within {seconds:g} s") from None
            except OSError:  # the child is gone (EPIPE)
                out = None
            except BaseException:  # interrupted mid-call (a signal's exception): its state is unknown
                self._end()
                raise
            if not (isinstance(out, list) and out and out[0] in ("ok", "memory", "raised")):
                self._end()
                raise Overrun("its process ended without an answer, out of memory or crashed")
            if out[0] == "memory":
                self._end()
                raise Overrun(f"it needed more than {self._max_bytes >> 20} MiB of memory")
        if out[0] == "ok" and len(out) == 2:
            return out[1]
        if out[0] == "raised" and len(out) == 3:
            raise Failed(str(out[1]), str(out[2]))
        raise Overrun("its process answered nonsense")

    def _call_here(self, request):
        try:
            if self._handler is None:
                self._handler = self._setup()
            return self._handler(request)
        except Exception as e:
            raise Failed(type(e).__name__, str(e)) from None

    def close(self):
        with self._lock:
            self._finalizer()
