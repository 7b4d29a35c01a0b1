"""The one compiled part: the planner's event loop (protocols/skippipe/_ceventloop.c), optional.

Without a C compiler (or Python's headers) the build skips it with a warning and the planner runs the same
loop in Python (protocols/skippipe/_eventloop.py): the same plans, in about twice the time. Everything else
is in pyproject.toml.
"""

import sys

from setuptools import Extension, setup

# Bit-identical to the Python loop: no fused multiply-adds, no reassociation.
FLAGS = [] if sys.platform == "win32" else ["-O2", "-ffp-contract=off", "-fno-fast-math"]

setup(
    ext_modules=[
        Extension(
            "protocols.skippipe._ceventloop",
            ["protocols/skippipe/_ceventloop.c"],
            depends=["protocols/skippipe/_ceventloop_heaps.h", "protocols/skippipe/_ceventloop_state.h"],
            extra_compile_args=FLAGS,
            optional=True,
        )
    ]
)
