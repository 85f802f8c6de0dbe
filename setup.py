"""The C extension of the match walk and the batch write (``sarp._native``);
everything else is in pyproject.toml.  The extension is optional: without a C
compiler the build skips it and sarp runs its Python path (``sarp.verify.NATIVE``
says which)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sarp._native",
            sources=["src/sarp/_native.c", "src/sarp/native_pack.c",
                     "src/sarp/native_events.c"],
            depends=["src/sarp/native.h", "src/sarp/vendor/xxhash.h"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
