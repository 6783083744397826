"""
The names that files outside plumbing/'s owners still import from here: encoding_from_spec
(tests/conftest.py, tests/test_edge_shapes.py, tests/test_serving_api.py) and
available_memory, format_bytes (serving/engine.py). Each check lives where its data is
built (plumbing/__init__.py lists the modules); once those imports name plumbing.tokenizer
and plumbing.memory, this file is deleted.
"""

from plumbing.memory import available_memory, format_bytes  # noqa: F401
from plumbing.tokenizer import encoding_from_spec  # noqa: F401
