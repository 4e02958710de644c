"""tf_keras: `accum.tf_keras._inner` (new-style) and `accum.tf_keras._inner_legacy` implement
`accum._inner.InnerApi`, and the private names they rely on exist on the installed tf_keras
(tests/helpers/accum_inner_checks.py)."""

from tests.helpers.accum_inner_checks import *  # noqa: F403 (the checks, collected here)
from tests.helpers.accum_inner_checks import tf_keras_apis  # noqa: F401 (the fixture api)
