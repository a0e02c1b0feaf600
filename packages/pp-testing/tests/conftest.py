"""Ranks of this suite start with a module the test modules never import (checked there)."""

from pp_testing import preload_in_ranks

preload_in_ranks("xml.dom.minidom")
