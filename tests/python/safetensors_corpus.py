"""A corpus of safetensors files, valid and malformed, with the reference package's verdicts.

``corpus()`` maps a short case name (usable as a file name) to a whole file's bytes. Every file is
built by hand (little-endian u64 header length + JSON header + data) rather than with the
``safetensors`` package, so that malformed files can be expressed. ``reference_verdict(path)``
gives what ``safetensors.torch.load_file`` (safetensors 0.8.0) decides: ``None`` when it accepts
the file, else the first line of its error text. Our reader must accept and refuse the same files.

What the reference does (found by running it on these cases):

- The header length is capped at 100,000,000 (``header too large``, checked before the file size);
  a length past the end of the file is ``invalid header length``; under 8 bytes ``header too
  small``. The header must be UTF-8 and one JSON object, with JSON whitespace (space, tab, CR, LF)
  allowed before and after it; anything else after it (NUL, form feed, ``x``) is refused.
- Duplicate tensor names: every occurrence must be well typed, but only the last one counts and is
  checked against the data (last wins). Duplicate keys inside a tensor entry and a duplicate
  ``__metadata__`` are refused; duplicate keys inside ``__metadata__`` are accepted (last wins).
- Tensors sorted by ``data_offsets`` must tile the data exactly from 0 (no hole, no overlap, no
  trailing bytes); zero-size tensors may share an offset. Element count times bits per element
  must fit in 64 bits, multiplied left to right (``[2**62, 4, 0]`` overflows, ``[0, 2**62, 4]``
  does not). Numbers must be non-negative JSON integers below 2**64; ``1.0``, ``-0``, ``1e2`` are
  refused. Unknown fields in a tensor entry are ignored (any JSON value); a tensor entry may also
  be a 3-element array ``[dtype, shape, data_offsets]`` and a dtype may be ``{"F32": null}``.
- Total nesting of arrays and objects is limited to 127 (``recursion limit exceeded`` at 128).
- F6_E2M3 and F6_E3M2 parse but ``safetensors.torch`` refuses them (``Dtype not understood``),
  even at size 0; F4 needs an even last dimension (shape halved in torch), even at size 0; a
  zero-size tensor with a dimension over 2**63 - 1 is refused by torch, not by the parser.

Names starting with ``valid_`` are accepted; other names are mostly refused, but a few are
accepted (some duplicates, some ``type_*``); the verdict, not the name, is what counts.

Cases in ``UNSTABLE_TEXT`` are refused every time, but the tensor named in the error text depends
on hash order (two tensors with equal ``data_offsets``); compare only the verdict for those.
"""

from __future__ import annotations

import struct
from pathlib import Path

UNSTABLE_TEXT = frozenset({"overlap_same_bytes", "duplicate_name_other_offsets_with_b"})

# dtype name -> bits per element, for the dtypes safetensors.torch loads (F4 needs even last dim).
TORCH_DTYPES = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8, "U16": 16, "I16": 16, "F16": 16, "BF16": 16, "U32": 32, "I32": 32,
    "F32": 32, "C64": 64, "U64": 64, "I64": 64, "F64": 64, "F4": 4,
}  # fmt: skip

_V = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'  # one F32 over the 4 data bytes
_D4 = bytes([0, 0, 128, 63])  # float32 1.0
_D8 = bytes(range(8))
_BIG = {"2p64": 2**64, "2p64m1": 2**64 - 1, "2p63": 2**63, "2p63m1": 2**63 - 1}
_NUMBERS = {  # offending number literals, by name
    **{k: str(v) for k, v in _BIG.items()},
    "neg": "-1", "neg_zero": "-0", "zero_point_zero": "0.0", "one_point_zero": "1.0",
    "fraction": "1.5", "exp": "1e2", "exp_upper": "1E2", "exp_exact": "4e0", "plus": "+4",
    "leading_zero": "04", "double_zero": "00", "huge_exp": "1e999", "neg_huge_exp": "-1e999",
    "hex": "0x4", "nan": "NaN", "infinity": "Infinity", "neg_infinity": "-Infinity",
}  # fmt: skip
_WRONG = {  # JSON values of every type, by name
    "null": "null", "true": "true", "false": "false", "int": "1", "neg": "-1", "float": "1.5",
    "string": '"s"', "empty_array": "[]", "array": "[1]", "empty_object": "{}",
    "object": '{"a":1}',
}  # fmt: skip


def _file(header: str | bytes, data: bytes = b"", n: int | None = None) -> bytes:
    """Length prefix (u64 little-endian, default the header's length) + header + data."""
    raw = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(raw) if n is None else n) + raw + data


def _entry(
    dtype: str = '"F32"', shape: str = "[1]", offsets: str = "[0,4]", extra: str = ""
) -> str:
    """A tensor entry as JSON text; each field is JSON text, so any type can be put there."""
    return f'{{"dtype":{dtype},"shape":{shape},"data_offsets":{offsets}{extra}}}'


def _one(entry: str = _V, data: bytes = _D4, name: str = "a") -> bytes:
    """A file holding one tensor entry under ``name``."""
    return _file(f'{{"{name}":{entry}}}', data)


def _padded(header: str, data: bytes) -> bytes:
    """A file as writers make it: the header padded with spaces to a multiple of 8 bytes."""
    raw = header.encode()
    return _file(raw + b" " * (-(8 + len(raw)) % 8), data)


def _valid(c: dict[str, bytes]) -> None:
    """Files the reference accepts, including the odd ones it tolerates."""
    entries, data = [], b""
    for name, bits in TORCH_DTYPES.items():
        n = 4 * bits // 8
        chunk = bytes((i * 37 + 11) % 256 for i in range(n))
        quoted = f'"{name}"'
        c[f"valid_dtype_{name.lower()}"] = _one(_entry(quoted, "[4]", f"[0,{n}]"), chunk)
        entry = _entry(quoted, "[2,2]", f"[{len(data)},{len(data) + n}]")
        entries.append(f'"t_{name.lower()}":{entry}')
        data += chunk
    meta = '{"format":"pt","k":"v"}'
    c["valid_all_dtypes"] = _padded(f'{{"__metadata__":{meta},{",".join(entries)}}}', data)
    c["valid_f4_zero_size"] = _one(_entry('"F4"', "[0]", "[0,0]"), b"")
    c["valid_f4_last_dim_zero"] = _one(_entry('"F4"', "[3,0]", "[0,0]"), b"")
    c["valid_scalar"] = _one(_entry(shape="[]"))
    c["valid_scalar_spaces"] = _one(_entry(shape="[ ]", offsets="[ 0 , 4 ]"))
    c["valid_empty_header"] = _file("{}")
    c["valid_empty_header_spaces"] = _file("{ }")
    c["valid_empty_header_padded"] = _file("{}      ")
    c["valid_two_tensors"] = _two()
    c["valid_two_tensors_padded"] = _padded(_TWO_HEADER, _TWO_DATA)
    c["valid_metadata"] = _file(f'{{"__metadata__":{meta},"a":{_V}}}', _D4)
    c["valid_metadata_last"] = _file(f'{{"a":{_V},"__metadata__":{meta}}}', _D4)
    c["valid_metadata_empty"] = _file(f'{{"__metadata__":{{}},"a":{_V}}}', _D4)
    c["valid_metadata_null"] = _file(f'{{"__metadata__":null,"a":{_V}}}', _D4)
    c["valid_metadata_only"] = _file(f'{{"__metadata__":{meta}}}')
    c["valid_metadata_escaped_key"] = _file(f'{{"\\u005f_metadata__":{meta},"a":{_V}}}', _D4)
    c["valid_metadata_escaped_nul"] = _file(f'{{"__metadata__":{{"k":"a\\u0000"}},"a":{_V}}}', _D4)
    c["valid_metadata_empty_key"] = _file(f'{{"__metadata__":{{"":""}},"a":{_V}}}', _D4)
    c["valid_metadata_key_like_tensor"] = _file(f'{{"__metadata__":{{"a":"x"}},"a":{_V}}}', _D4)
    z = _entry(shape="[0]", offsets="[0,0]")
    c["valid_zero_size_only"] = _one(z, b"")
    z8 = _entry('"I8"', "[0,5]", "[0,0]")
    c["valid_zero_size_two_no_data"] = _file(f'{{"a":{z},"b":{z8}}}')
    c["valid_zero_size_at_start"] = _file(f'{{"z":{z},"a":{_V}}}', _D4)
    z4 = _entry(shape="[0]", offsets="[4,4]")
    c["valid_zero_size_at_end"] = _file(f'{{"a":{_V},"z":{z4}}}', _D4)
    mid = [_entry(shape=s, offsets="[4,4]") for s in ("[0]", "[0,3]", "[3,0]")]
    c["valid_zero_size_same_offset"] = _file(
        f'{{"a":{_V},"x":{mid[0]},"y":{mid[1]},"z":{mid[2]},"b":{_entry(offsets="[4,8]")}}}', _D8
    )
    for name, shape in [("0_2p62_4", f"[0,{2**62},4]"), ("0_2p63m1", f"[0,{2**63 - 1}]"),
                        ("2p63m1_0", f"[{2**63 - 1},0]")]:  # fmt: skip
        c[f"valid_zero_size_shape_{name}"] = _one(_entry(shape=shape, offsets="[0,0]"), b"")
    c["valid_offsets_unordered"] = _file(
        '{"c":' + _entry('"U8"', "[1]", "[2,3]") + ',"a":' + _entry('"U8"', "[1]", "[0,1]")
        + ',"b":' + _entry('"U8"', "[1]", "[1,2]") + "}", b"xyz"
    )  # fmt: skip
    for name, extra in [("unknown_field", ',"foo":1'), ("unknown_field_dup", ',"foo":1,"foo":"x"'),
                        ("unknown_field_nested", ',"foo":{"a":[[1,2],[3,{"b":null}]],"c":true}'),
                        ("unknown_field_2p64", f',"foo":{2**64}'),
                        ("unknown_field_float", ',"foo":-1.5e-3')]:  # fmt: skip
        c[f"valid_{name}"] = _one(_entry(extra=extra))
    c["valid_unknown_field_first"] = _one('{"foo":[],' + _V[1:])
    c["valid_entry_as_array"] = _one('["F32",[1],[0,4]]')
    c["valid_dtype_as_map"] = _one(_entry(dtype='{"F32":null}'))
    c["valid_entry_array_with_map_dtype"] = _one('[{"F32":null},[1],[0,4]]')
    for name, key in [("escaped_nul", "a\\u0000b"), ("surrogate_pair", "a\\ud83d\\ude00"),
                      ("utf8", "a\u00e9\U0001f600"), ("escaped_tab", "a\\tb"), ("del", "a\x7fb"),
                      ("empty", ""), ("escaped_slash", "a\\/b"), ("escape_upper", "a\\u00E9"),
                      ("metadata_like", "__metadata__x")]:  # fmt: skip
        c[f"valid_name_{name}"] = _one(name=key)
    c["valid_key_escaped_dtype"] = _one(_V.replace('"dtype"', '"\\u0064type"'))
    c["valid_dtype_escaped_value"] = _one(_V.replace('"F32"', '"F\\u00332"'))
    for name, lead, trail in [
        ("leading_space", " ", ""), ("leading_tab_cr_lf", "\t\r\n", ""),
        ("trailing_spaces", "", "    "), ("trailing_tab_lf_cr", "", "\t\n\r "),
    ]:  # fmt: skip
        c[f"valid_{name}"] = _file(f'{lead}{{"a":{_V}}}{trail}', _D4)
    c["valid_whitespace_inside"] = _file(
        '{ "a" : { "dtype" : "F32" ,\n"shape" : [ 1 ] , "data_offsets" : [ 0 , 4 ] } }', _D4
    )
    c["valid_length_pads_header"] = _file(f'{{"a":{_V}}} ', _D4)
    for kind in ("arrays", "objects"):
        inner = "[" * 125 + "]" * 125 if kind == "arrays" else '{"a":' * 125 + "1" + "}" * 125
        c[f"valid_depth_125_{kind}_in_unknown_field"] = _one(_entry(extra=f',"foo":{inner}'))


_TWO_HEADER = (
    '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
    '"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}}'
)
_TWO_DATA = bytes([0, 0, 128, 63, 0, 0, 0, 64, 7, 8, 9])


def _two() -> bytes:
    """The small valid two-tensor file that the truncation cases cut."""
    return _file(_TWO_HEADER, _TWO_DATA)


def _duplicates(c: dict[str, bytes]) -> None:
    """Duplicate tensor names, duplicate fields, duplicate metadata keys."""
    i32 = _entry('"I32"', "[2]", "[0,8]")
    f32 = _entry('"F32"', "[2]", "[0,8]")
    lo, hi = _entry(offsets="[0,4]"), _entry(offsets="[4,8]")
    bad_size, xx = _entry(shape="[7]"), _entry(dtype='"XX"')
    f6, out = _entry('"F6_E2M3"', "[4]", "[0,3]"), _entry(offsets="[100,104]")
    for name, body, data in [
        ("identical", f'"a":{_V},"a":{_V}', _D4),
        ("other_dtype", f'"a":{f32},"a":{i32}', _D8),
        ("other_dtype_reversed", f'"a":{i32},"a":{f32}', _D8),
        ("other_shape", f'"a":{f32},"a":{_entry(shape="[1,2]", offsets="[0,8]")}', _D8),
        ("other_offsets", f'"a":{lo},"a":{hi}', _D8),
        ("other_offsets_reversed", f'"a":{hi},"a":{lo}', _D8),
        ("other_offsets_with_b", f'"a":{lo},"b":{hi},"a":{hi}', _D8),
        ("with_b_between", f'"a":{_V},"b":{_entry(shape="[0]", offsets="[4,4]")},"a":{_V}', _D4),
        ("first_unknown_dtype", f'"a":{xx},"a":{_V}', _D4),
        ("first_null", f'"a":null,"a":{_V}', _D4),
        ("first_bad_size", f'"a":{bad_size},"a":{_V}', _D4),
        ("first_out_of_file", f'"a":{out},"a":{_V}', _D4),
        ("first_f6", f'"a":{f6},"a":{_V}', _D4),
        ("last_bad_size", f'"a":{_V},"a":{bad_size}', _D4),
        ("array_then_object", f'"a":["F32",[1],[0,4]],"a":{_V}', _D4),
    ]:
        c[f"duplicate_name_{name}"] = _file("{" + body + "}", data)
    for field, value in [("dtype", '"F32"'), ("shape", "[1]"), ("data_offsets", "[0,4]")]:
        c[f"duplicate_field_{field}"] = _one(_entry(extra=f',"{field}":{value}'))
    c["duplicate_field_dtype_differs"] = _one(_entry(extra=',"dtype":"I32"'))
    c["duplicate_field_after_unknown_twice"] = _one(_entry(extra=',"foo":1,"foo":2,"dtype":"F32"'))
    twice = '"__metadata__":{"x":"1"},"__metadata__":'
    for name, head in [
        ("duplicate_metadata", twice + '{"x":"1"}'),
        ("duplicate_metadata_differs", twice + '{"y":"2"}'),
        ("valid_metadata_duplicate_key", '"__metadata__":{"x":"1","x":"1"}'),
        ("valid_metadata_duplicate_key_differs", '"__metadata__":{"x":"1","x":"2"}'),
        ("metadata_duplicate_key_first_not_string", '"__metadata__":{"x":1,"x":"2"}'),
    ]:
        c[name] = _file(f'{{{head},"a":{_V}}}', _D4)


def _layout(c: dict[str, bytes]) -> None:
    """Offsets that do not tile the data region, and sizes that do not match."""
    c["overlap_same_bytes"] = _file(f'{{"a":{_V},"b":{_V}}}', _D4)
    c["hole_between"] = _file(f'{{"a":{_V},"b":{_entry(offsets="[5,9]")}}}', bytes(9))
    c["bytes_after_last"] = _one(data=_D8)
    c["data_shorter"] = _one(_entry(shape="[2]", offsets="[0,8]"), _D4)
    c["data_missing"] = _one(data=b"")
    c["first_offset_not_zero"] = _one(_entry(offsets="[4,8]"), _D8)
    c["end_before_begin"] = _one(_entry(shape="[0]", offsets="[4,0]"), b"")
    c["end_before_begin_second"] = _file(
        f'{{"a":{_V},"b":{_entry(shape="[0]", offsets="[4,0]")}}}', _D4
    )
    c["end_before_begin_after_zero"] = _file(
        f'{{"z":{_entry(shape="[0]", offsets="[0,0]")},"a":{_entry(offsets="[8,4]")}}}', _D8
    )
    c["zero_size_then_bytes"] = _one(_entry(shape="[0]", offsets="[0,0]"), _D4)
    c["zero_size_past_start"] = _one(_entry(shape="[0]", offsets="[4,4]"), _D4)
    c["empty_header_with_data"] = _file("{}", b"\x00")
    c["scalar_wrong_size"] = _one(_entry(shape="[]", offsets="[0,8]"), _D8)
    c["size_mismatch"] = _one(_entry(offsets="[0,8]"), _D8)
    c["offset_end_2p64m1"] = _one(_entry(offsets=f"[0,{2**64 - 1}]"))
    c["offset_begin_2p64m1"] = _one(_entry(shape="[0]", offsets=f"[{2**64 - 1},{2**64 - 1}]"), b"")
    for name, dtype, shape in [
        ("2p62_4_0", "F32", f"[{2**62},4,0]"), ("2p60_f32", "F32", f"[{2**60}]"),
        ("2p61_u8", "U8", f"[{2**61}]"), ("2p32_2p32", "F32", f"[{2**32},{2**32}]"),
        ("2p32_2p32_0", "F32", f"[{2**32},{2**32},0]"), ("2p64m1_0", "F32", f"[{2**64 - 1},0]"),
        ("0_2p64m1", "F32", f"[0,{2**64 - 1}]"), ("2p63_0", "F32", f"[{2**63},0]"),
    ]:  # fmt: skip
        c[f"shape_overflow_{name}"] = _one(_entry(f'"{dtype}"', shape, "[0,0]"), b"")


def _dtypes(c: dict[str, bytes]) -> None:
    """Dtypes the parser knows but torch does not, sub-byte misalignment, unknown names."""
    for name in ("F6_E2M3", "F6_E3M2"):
        c[f"dtype_{name.lower()}"] = _one(_entry(f'"{name}"', "[4]", "[0,3]"), bytes(3))
        c[f"dtype_{name.lower()}_zero_size"] = _one(_entry(f'"{name}"', "[0]", "[0,0]"), b"")
    c["dtype_f6_e2m3_one_element"] = _one(_entry('"F6_E2M3"', "[1]", "[0,0]"), b"")
    for shape, n in [("[1]", 0), ("[3]", 1), ("[]", 0), ("[2,1]", 1), ("[0,1]", 0)]:
        tag = shape.strip("[]").replace(",", "_") or "scalar"
        c[f"dtype_f4_shape_{tag}"] = _one(_entry('"F4"', shape, f"[0,{n}]"), bytes(n))
    for name, dtype in [("f128", '"F128"'), ("lowercase", '"f32"'), ("f8_e4m3fn", '"F8_E4M3FN"'),
                        ("empty", '""'), ("trailing_space", '"F32 "'), ("map_list", '{"F32":[]}'),
                        ("map_object", '{"F32":{}}'), ("map_int", '{"F32":1}'),
                        ("map_two_keys", '{"F32":null,"I32":null}'),
                        ("map_lowercase", '{"f32":null}')]:  # fmt: skip
        c[f"dtype_{name}"] = _one(_entry(dtype=dtype))


def _fields(c: dict[str, bytes]) -> None:
    """Missing fields, wrong arities, and every JSON type in every field."""
    c["missing_dtype"] = _one('{"shape":[1],"data_offsets":[0,4]}')
    c["missing_shape"] = _one('{"dtype":"F32","data_offsets":[0,4]}')
    c["missing_data_offsets"] = _one('{"dtype":"F32","shape":[1]}')
    c["data_offsets_one"] = _one(_entry(offsets="[4]"))
    c["data_offsets_three"] = _one(_entry(offsets="[0,4,4]"))
    c["shape_nested"] = _one(_entry(shape="[[1]]"))
    c["entry_array_short"] = _one('["F32",[1]]')
    c["entry_array_long"] = _one('["F32",[1],[0,4],1]')
    c["metadata_tensor_like"] = _file(f'{{"__metadata__":{_V}}}', _D4)
    for kind, v in _WRONG.items():
        c[f"type_dtype_{kind}"] = _one(_entry(dtype=v))
        c[f"type_shape_{kind}"] = _one(_entry(shape=v))
        c[f"type_shape_elem_{kind}"] = _one(_entry(shape=f"[{v}]"))
        c[f"type_data_offsets_{kind}"] = _one(_entry(offsets=v))
        c[f"type_offset_begin_{kind}"] = _one(_entry(offsets=f"[{v},4]"))
        c[f"type_offset_end_{kind}"] = _one(_entry(offsets=f"[0,{v}]"))
        c[f"type_metadata_{kind}"] = _file(f'{{"__metadata__":{v},"a":{_V}}}', _D4)
        c[f"type_metadata_value_{kind}"] = _file(f'{{"__metadata__":{{"k":{v}}},"a":{_V}}}', _D4)
        c[f"type_entry_{kind}"] = _one(v)
        c[f"type_header_{kind}"] = _file(v, _D4 if kind in ("object", "empty_object") else b"")
    for kind, lit in _NUMBERS.items():
        c[f"number_offset_end_{kind}"] = _one(_entry(offsets=f"[0,{lit}]"))
        c[f"number_offset_begin_{kind}"] = _one(_entry(shape="[0]", offsets=f"[{lit},0]"), b"")
        c[f"number_shape_{kind}"] = _one(_entry(shape=f"[{lit}]"))


def _text(c: dict[str, bytes]) -> None:
    """Strings (NUL, UTF-8, surrogates, control characters) and JSON syntax outside the standard."""

    def name(raw: bytes) -> bytes:
        return _file(b'{"' + raw + b'":' + _V.encode() + b"}", _D4)

    c["name_raw_nul"] = name(b"a\x00b")
    c["name_invalid_utf8"] = name(b"a\xffb")
    c["name_overlong_utf8"] = name(b"a\xc0\x80b")
    c["name_utf8_surrogate"] = name(b"a\xed\xa0\x80b")
    c["name_lone_surrogate"] = name(b"a\\ud800b")
    c["name_lone_surrogate_at_end"] = name(b"a\\ud800")
    c["name_lone_low_surrogate"] = name(b"a\\udc00b")
    c["name_surrogate_then_bmp"] = name(b"a\\ud800\\u0041")
    c["name_raw_tab"] = name(b"a\tb")
    c["name_raw_newline"] = name(b"a\nb")
    c["name_bad_escape"] = name(b"a\\xb")
    c["name_short_unicode_escape"] = name(b"a\\u12")
    c["metadata_value_raw_nul"] = _file(f'{{"__metadata__":{{"k":"a\x00"}},"a":{_V}}}', _D4)
    c["dtype_raw_nul"] = _one(_V.replace('"F32"', '"F32\x00"'))
    one = f'"a":{_V}'
    for key, header in [
        ("leading_bom", f"\ufeff{{{one}}}"), ("leading_nul", f"\x00{{{one}}}"),
        ("trailing_nul", f"{{{one}}}\x00\x00"), ("trailing_garbage", f"{{{one}}}x"),
        ("trailing_formfeed", f"{{{one}}}\x0c"), ("trailing_nbsp", f"{{{one}}}\u00a0"),
        ("trailing_brace", f"{{{one}}}}}"), ("trailing_object", f"{{{one}}}{{}}"),
        ("comment_block", f"{{/*c*/{one}}}"), ("comment_line", f"{{{one}}}//c"),
        ("single_quotes", f"{{{one}}}".replace('"', "'")), ("trailing_comma", f"{{{one},}}"),
        ("trailing_comma_entry", '{"a":' + _V[:-1] + ",}}"),
        ("trailing_comma_shape", '{"a":' + _V.replace("[1]", "[1,]") + "}"),
        ("unquoted_key", f"{{a:{_V}}}"), ("numeric_key", f"{{1:{_V}}}"),
        ("nan_in_unknown_field", '{"a":' + _entry(extra=',"foo":NaN') + "}"),
        ("infinity_in_unknown_field", '{"a":' + _entry(extra=',"foo":Infinity') + "}"),
        ("huge_exp_in_unknown_field", '{"a":' + _entry(extra=',"foo":1e999') + "}"),
        ("bad_escape_in_unknown_field", '{"a":' + _entry(extra=',"foo":"\\ud800"') + "}"),
        ("empty_header", ""), ("whitespace_header", "   "), ("open_brace_only", "{"),
    ]:  # fmt: skip
        c[f"json_{key}"] = _file(header, _D4)


def _depth(c: dict[str, bytes]) -> None:
    """Nesting at the limit and past it, and three 100,000-deep headers."""
    for kind, (o, m, e) in {"arrays": ("[", "", "]"), "objects": ('{"a":', "1", "}")}.items():
        deep = f',"foo":{o * 126}{m}{e * 126}'
        c[f"depth_126_{kind}_in_unknown_field"] = _one(_entry(extra=deep))
    c["depth_126_arrays_as_entry"] = _file('{"a":' + "[" * 126 + "]" * 126 + "}")
    c["depth_127_arrays_as_entry"] = _file('{"a":' + "[" * 127 + "]" * 127 + "}")
    c["depth_125_arrays_in_shape"] = _one(_entry(shape="[" * 125 + "]" * 125))
    c["depth_126_arrays_in_shape"] = _one(_entry(shape="[" * 126 + "]" * 126))
    c["nest_100000_brackets"] = _file("[" * 100_000)
    c["nest_100000_objects"] = _file('{"a":' * 100_000)
    c["nest_100000_in_unknown_field"] = _one(_entry(extra=',"foo":' + "[" * 100_000)[:-1])


def _lengths(c: dict[str, bytes]) -> None:
    """The 8-byte length prefix: short files, zero, past the end, the 100,000,000 cap."""
    one = f'{{"a":{_V}}}'.encode()
    c["length_empty_file"] = b""
    c["length_file_7_bytes"] = b"\x02" + bytes(6)
    c["length_zero_no_header"] = struct.pack("<Q", 0)
    c["length_zero_with_header"] = _file(one, _D4, n=0)
    c["length_one_space"] = _file(" ")
    c["length_one_past_file"] = _file(one, _D4, n=len(one) + 5)
    c["length_short_of_json"] = _file(one, _D4, n=len(one) - 1)
    c["length_includes_data"] = _file(one, _D4, n=len(one) + 4)
    c["length_big_endian"] = struct.pack(">Q", len(one)) + one + _D4
    for name, n in [("2p64m1", 2**64 - 1), ("2p63", 2**63), ("hi_bits", 2**32 + len(one)),
                    ("cap", 100_000_000), ("cap_plus_1", 100_000_001)]:  # fmt: skip
        c[f"length_{name}"] = _file(one, _D4, n=n)


def _truncations(c: dict[str, bytes]) -> None:
    """The valid two-tensor file cut at every byte, and its header cut at every token edge."""
    whole = _two()
    for i in range(len(whole)):
        c[f"truncated_file_at_{i:03d}"] = whole[:i]
    edges = sorted({i for i, ch in enumerate(_TWO_HEADER) if ch in '{}[],:"'}
                   | {i + 1 for i, ch in enumerate(_TWO_HEADER) if ch in '{}[],:"'})  # fmt: skip
    for i in edges:
        if i < len(_TWO_HEADER):
            c[f"truncated_header_at_{i:03d}"] = _file(_TWO_HEADER[:i], _TWO_DATA)


def corpus() -> dict[str, bytes]:
    """Every case: name (letters, digits, underscores) -> the whole file's bytes. Deterministic."""
    c: dict[str, bytes] = {}
    for add in (_valid, _duplicates, _layout, _dtypes, _fields, _text, _depth, _lengths,
                _truncations):  # fmt: skip
        add(c)
    return c


def write_corpus(folder: str | Path) -> dict[str, Path]:
    """Write every case to ``folder/<name>.safetensors``; return name -> path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, data in corpus().items():
        paths[name] = folder / f"{name}.safetensors"
        paths[name].write_bytes(data)
    return paths


def reference_verdict(path: str | Path) -> str | None:
    """None if ``safetensors.torch.load_file`` accepts the file, else its error's first line."""
    from safetensors.torch import load_file

    try:
        load_file(str(path))
    except Exception as e:  # any refusal counts, whatever its type
        return (str(e).splitlines() or [type(e).__name__])[0]
    return None
