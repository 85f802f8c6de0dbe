"""The C extension of the match walk and the batch write (``sarp._native``);
everything else is in pyproject.toml.  The extension is optional: without a C
compiler the build skips it and sarp runs its Python path (``sarp.native.AVAILABLE``
says which)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sarp._native",
            # each C file beside the Python it mirrors (src/sarp/native.h lists them)
            sources=["src/sarp/native.c", "src/sarp/verify.c", "src/sarp/packing.c",
                     "src/sarp/serving/events.c", "src/sarp/serving/http.c", "src/sarp/serving/rfc.c",
                     "src/sarp/serving/wire.c", "src/sarp/serving/lane.c",
                     "src/sarp/tokenkeys.c", "src/sarp/directory.c", "src/sarp/segment.c",
                     "src/sarp/valkey_read.c", "src/sarp/aliastable.c",
                     "src/sarp/lmdb_env.c"],
            depends=["src/sarp/native.h", "src/sarp/vendor/xxhash.h"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
