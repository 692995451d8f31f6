"""Running untrusted work (a checkpoint's chat template) with a time and memory bound.

jinja2's sandbox stops a template from reaching files or Python internals, but not from
looping for hours (nested loops, recursive macros) or building a gigabyte string
(`'x' * 10**10`, `'x'.center(10**10)`, a namespace doubling a string in a loop); even
compiling one can do that, since jinja2 folds constant expressions.  No check on the
template text can rule all of these out, so the work runs in a forked child: it gets an
address-space limit of what the process maps now plus `max_bytes`, and is killed when it
runs past `seconds`.  The child only runs Python code of this process's image and leaves
with os._exit, so the other threads it does not inherit (BLAS workers, a communicator's)
are never waited for.

Where fork is missing (not Linux or macOS) the work runs in-process, unbounded."""
import os
import pickle
import select
import signal
import time
import warnings


class Overrun(Exception):
    """The work ran past its time or memory bound, or its process died."""


class Failed(Exception):
    """The work raised: .kind is the exception's class name, .text its message."""

    def __init__(self, kind, text):
        super().__init__(f"{kind}: {text}")
        self.kind, self.text = kind, text


def _vm_bytes():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def run(fn, seconds=10.0, max_bytes=512 << 20):
    """fn() in a forked child; returns its result (which must pickle).  Raises Failed when
    fn raised, Overrun when it ran out of time or memory or its process died."""
    if not hasattr(os, "fork"):
        try:
            return fn()
        except Exception as e:
            raise Failed(type(e).__name__, str(e)) from None
    vm = _vm_bytes()
    r, w = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns on fork with threads; see the docstring
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 0
        try:
            os.close(r)
            signal.setitimer(signal.ITIMER_REAL, 0)  # a timer of the parent's is not the child's
            if vm is not None:
                import resource
                _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
                limit = vm + max_bytes if hard == resource.RLIM_INFINITY else min(vm + max_bytes, hard)
                resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
            try:
                out = ("ok", fn())
            except MemoryError:
                out = ("memory", "")
            except BaseException as e:
                out = ("raised", type(e).__name__, str(e)[:4000])
            data = pickle.dumps(out)
            with os.fdopen(w, "wb") as f:
                f.write(data)
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    chunks, deadline, timed_out = [], time.monotonic() + seconds, False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select([r], [], [], left)
            if ready:
                b = os.read(r, 1 << 16)
                if not b:
                    break
                chunks.append(b)
    finally:
        os.close(r)
        if timed_out:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    if timed_out:
        raise Overrun(f"it did not finish within {seconds:g} s")
    try:
        out = pickle.loads(b"".join(chunks))
    except Exception:
        out = None
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and isinstance(out, tuple)):
        raise Overrun(f"its process ended without an answer (status {status:#x}), out of memory or crashed")
    if out[0] == "ok":
        return out[1]
    if out[0] == "memory":
        raise Overrun(f"it needed more than {max_bytes >> 20} MiB of memory")
    raise Failed(out[1], out[2])
