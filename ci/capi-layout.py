#!/usr/bin/env python3
"""Computes every struct of include/xccl.h as a binding would from the header alone (ctypes,
field by field from the declared types), and prints `struct field offset size` lines and one
`struct sizeof N` line per struct, for ci/check-capi.sh to compare with the C compiler's."""
import ctypes
import re
import sys

SCALARS = {
    "size_t": ctypes.c_size_t,
    "int": ctypes.c_int,
    "unsigned int": ctypes.c_uint,
    "uint64_t": ctypes.c_uint64,
    "uint32_t": ctypes.c_uint32,
    "int32_t": ctypes.c_int32,
    "float": ctypes.c_float,
    "char": ctypes.c_char,
}

header = open(sys.argv[1]).read()
# Comments out, so that only declarations remain.
code = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
structs = {}
for body, name in re.findall(r"typedef struct \{(.*?)\}\s*(\w+);", code, flags=re.S):
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        m = re.fullmatch(r"(?:const )?([\w ]+?)\s*(\**)\s*(\w+)(?:\[(\d+)\])?", decl)
        if not m:
            sys.exit(f"capi-layout: cannot read field `{decl}` of {name}")
        base, stars, field, count = m.groups()
        if stars:
            ty = ctypes.c_void_p
        elif base in SCALARS:
            ty = SCALARS[base]
        elif base in structs:
            ty = structs[base]
        else:
            sys.exit(f"capi-layout: unknown type `{base}` of {name}.{field}")
        if count:
            ty = ty * int(count)
        fields.append((field, ty))
    structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields})
    for field, _ in fields:
        f = getattr(structs[name], field)
        print(f"{name} {field} {f.offset} {f.size}")
    print(f"{name} sizeof {ctypes.sizeof(structs[name])}")
