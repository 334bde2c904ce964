"""The command line's names for the library's fields.

The library names a bad value by its field (``gpus must be in 1..65536, got 0``,
:class:`~varuna_core.errors.FieldError`); a user of ``varuna plan`` typed ``--gpus``, so the CLI says
``--gpus must be in 1..65536, got 0``. Each command maps the fields of the request it builds to its options.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from varuna_core.errors import FieldError

__all__ = ["named_as_options"]


@contextlib.contextmanager
def named_as_options(options: Mapping[str, str]) -> Iterator[None]:
    """Re-raise a :class:`FieldError` about a field of ``options`` (field name -> option) naming the option."""
    try:
        yield
    except FieldError as exc:
        if exc.field not in options:
            raise
        raise exc.renamed(options[exc.field]) from None
