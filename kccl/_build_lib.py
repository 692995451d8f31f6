"""Builds libkccl.so, the one copy of KCCL's C core in a process: the Python
package's cffi module links it, and so does native code that works on the
communicators Python makes (KIE's GPU engine, bench/native; link_args says how
a module of this package links it), as C programs do.  It holds the C core plus
the CUDA objects when they were built and exports only the API of kccl.h
(kccl* names), with a pkg-config file and a CMake package config beside it.

    kccl/lib/libkccl.so
    kccl/lib/pkgconfig/kccl.pc            pkg-config --cflags --libs kccl
    kccl/lib/cmake/kccl/kcclConfig.cmake  find_package(kccl) -> target kccl::kccl
    kccl/include/                         copies of kccl_native/include: the public headers
                                          (kccl.h, kccl_device.cuh, kccl_launch.cuh,
                                          kccl_settings.def) and kccl_device/, the device
                                          API's internals

`python -m kccl.paths` prints the directories to point PKG_CONFIG_PATH or
CMAKE_PREFIX_PATH at.  Run by setup.py through kccl/_build_ffi.py."""
import glob
import os
import shutil
import subprocess
import sys

VERSION = "0.1.0"


def _run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"libkccl: {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")


def build(root, cuda_objects, cuda_libdirs, cuda_libs, defines):
    native = os.path.join(root, "kccl_native")
    pkg = os.path.join(root, "kccl")
    libdir, incdir = os.path.join(pkg, "lib"), os.path.join(pkg, "include")
    objdir = os.path.join(root, "build", "libkccl")
    for d in (libdir, incdir, objdir, os.path.join(libdir, "pkgconfig"), os.path.join(libdir, "cmake", "kccl")):
        os.makedirs(d, exist_ok=True)
    # The public headers (kccl.h, kccl_device.cuh, kccl_launch.cuh, the settings table) and kccl_device/,
    # the internals kccl_device.cuh includes; a fresh copy, so that a header moved or
    # removed in the sources is not shipped from an older build.
    shutil.rmtree(incdir, ignore_errors=True)
    shutil.copytree(os.path.join(native, "include"), incdir)
    cc = os.environ.get("CC", "gcc")
    objs = []
    for src in sorted(glob.glob(os.path.join(native, "src", "*.c"))):
        obj = os.path.join(objdir, os.path.basename(src)[:-2] + ".o")
        # -fno-semantic-interposition: calls inside the library may be inlined and bound
        # directly, as if the API were not exported (nothing interposes on kccl.h).
        _run([cc, "-O3", "-std=gnu11", "-fPIC", "-fno-semantic-interposition", "-Wall",
              *[f"-D{k}={v}" for k, v in defines],
              "-I", os.path.join(native, "include"), "-c", src, "-o", obj])
        objs.append(obj)
    # Only the API leaves the library: kccl followed by a capital (kcclAllReduce...);
    # the core's own kccl_* and kgpu_* helpers stay inside.
    script = os.path.join(objdir, "exports.map")
    with open(script, "w") as f:
        f.write("{\n  global: kccl[A-Z]*;\n  local: *;\n};\n")
    out = os.path.join(libdir, "libkccl.so")
    _run([cc, "-shared", "-o", out, *objs, *[os.path.join(root, o) for o in cuda_objects],
          *[f"-L{d}" for d in cuda_libdirs], *[f"-l{x}" for x in cuda_libs], "-lrt", "-lpthread",
          f"-Wl,--version-script={script}", "-Wl,-soname,libkccl.so"])
    with open(os.path.join(libdir, "pkgconfig", "kccl.pc"), "w") as f:
        # ${pcfiledir}: the file's own folder, so the package can move (an installed wheel)
        f.write(f"prefix=${{pcfiledir}}/../..\nincludedir=${{prefix}}/include\nlibdir=${{prefix}}/lib\n\n"
                f"Name: kccl\nDescription: low-latency collectives over peer-mapped memory\nVersion: {VERSION}\n"
                f"Cflags: -I${{includedir}}\nLibs: -L${{libdir}} -Wl,-rpath,${{libdir}} -lkccl\n")
    with open(os.path.join(libdir, "cmake", "kccl", "kcclConfig.cmake"), "w") as f:
        f.write(f"# find_package(kccl): the imported target kccl::kccl (library and include directory).\n"
                f"get_filename_component(_kccl_prefix \"${{CMAKE_CURRENT_LIST_DIR}}/../../..\" ABSOLUTE)\n"
                f"add_library(kccl::kccl SHARED IMPORTED)\n"
                f"set_target_properties(kccl::kccl PROPERTIES\n"
                f"  IMPORTED_LOCATION \"${{_kccl_prefix}}/lib/libkccl.so\"\n"
                f"  IMPORTED_SONAME libkccl.so\n"
                f"  INTERFACE_INCLUDE_DIRECTORIES \"${{_kccl_prefix}}/include\")\n"
                f"set(kccl_VERSION {VERSION})\nset(kccl_FOUND TRUE)\n")
    print(f"libkccl: {out}", file=sys.stderr)
    build_nccl_shim(root, cc, libdir, objdir, objs, [os.path.join(root, o) for o in cuda_objects], cuda_libdirs,
                    cuda_libs, defines)
    return out


def handle_cdef(root):
    """kccl.h's communicator handle (typedef struct kcclComm *kcclComm_t;) for the cffi cdef
    of a module whose header takes one: cffi's cdef reads no #include."""
    import re
    with open(os.path.join(root, "kccl_native", "include", "kccl.h")) as f:
        (line,) = re.findall(r"^typedef struct \w+ \*kcclComm_t;$", f.read(), flags=re.M)
    return line + "\n"


def link_args(root, module_dir):
    """set_source keyword arguments that link an extension module landing in
    `module_dir` (a folder of this source tree, e.g. kie_engine/gpu) against
    libkccl.so: found at run time relative to the module ($ORIGIN), so that an
    installed package, whose folders keep their places, finds it too."""
    libdir = os.path.join(root, "kccl", "lib")
    return {"library_dirs": [os.path.relpath(libdir, root)], "libraries": ["kccl"],
            "extra_link_args": [f"-Wl,-rpath,$ORIGIN/{os.path.relpath(libdir, module_dir)}"]}


def nccl_shim_functions(root):
    """The NCCL functions the shim exports (kccl_native/nccl/nccl_functions.def and the
    two that return strings)."""
    import re
    text = open(os.path.join(root, "kccl_native", "nccl", "nccl_functions.def")).read()
    return sorted(re.findall(r"^NCCL_(?:FN|ROUTED)\((nccl\w+),", text, flags=re.M)
                  + ["ncclGetErrorString", "ncclGetLastError"])


def build_nccl_shim(root, cc, libdir, objdir, core_objs, cuda_objects, cuda_libdirs, cuda_libs, defines):
    """libkccl_nccl.so: NCCL's C interface (kccl_native/nccl/) with its own copy of the
    KCCL core inside, so that it needs neither libkccl.so nor the Python package, and
    exports only nccl* names."""
    nccl = os.path.join(root, "kccl_native", "nccl")
    script = os.path.join(objdir, "nccl_exports.map")
    with open(script, "w") as f:
        f.write("{\n  global: nccl[A-Z]*;\n  local: *;\n};\n")
    # route.c calls the CUDA runtime itself (bootstrap memory, the caller's device).  The shim
    # sees kccl.h only, not the core's sources (tests/test_boundaries.py keeps it so).
    cuda_inc = [f"-I{os.path.join(os.path.dirname(d), 'include')}" for d in cuda_libdirs]
    objs = []
    for name in ("shim.c", "route.c"):
        obj = os.path.join(objdir, "nccl_" + name[:-2] + ".o")
        # A core helper called without kccl.h declaring it would compile with an implicit
        # int result (and link, the core's objects being in the same library): an error.
        _run([cc, "-O2", "-std=gnu11", "-fPIC", "-Wall", "-Werror=implicit-function-declaration", "-fvisibility=hidden",
              *[f"-D{k}={v}" for k, v in defines], "-I", nccl, "-I", os.path.join(root, "kccl_native", "include"),
              *cuda_inc, "-c", os.path.join(nccl, name), "-o", obj])
        objs.append(obj)
    out = os.path.join(libdir, "libkccl_nccl.so")
    _run([cc, "-shared", "-o", out, *objs, *core_objs, *cuda_objects, *[f"-L{d}" for d in cuda_libdirs],
          *[f"-l{x}" for x in cuda_libs], "-ldl", "-lrt", "-lpthread", f"-Wl,--version-script={script}",
          "-Wl,-soname,libkccl_nccl.so", "-Wl,--no-undefined"])
    print(f"libkccl_nccl: {out}", file=sys.stderr)
    return out
