"""The ``cuda_src`` kernel-declaration scanner lives in ``foxhunt.fast.cuda_parse`` (one parser:
the fast step plan binds its launch records to the parameter names it reads); this module
re-exports it for the conformance registry and its tests."""

from foxhunt.fast.cuda_parse import (  # noqa: F401 - re-exports
    SUFFIXES,
    CudaParseError,
    KernelDecl,
    parse_cuda_dir,
    parse_kernels,
    split_params,
    strip_comments,
)
