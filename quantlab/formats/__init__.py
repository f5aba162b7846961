"""Storage formats: one `Codec` per format (`codec.py`), the layout of a layer (`layout.py`), and the
pure functions they share (grouping, packing). Nothing here knows about modules or transformers;
each function is tested bit-exactly.

Importing the package registers the built-in codecs: affine, int8, nf4, iq4_nl, lut.
"""

from quantlab.formats import affine, int8, iq4_nl, learned_table, nf4  # noqa: F401  (registers the built-in codecs)
