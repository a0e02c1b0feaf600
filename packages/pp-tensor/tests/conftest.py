"""Every rank of this suite starts with pp-tensor already imported."""

from pp_testing import preload_in_ranks

preload_in_ranks("pp_tensor")
