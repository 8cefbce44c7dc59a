"""The optional native part: one C file the GPU worker loop calls through ctypes
(``foxhunt_stream/cuda/native_land.c``). Where it cannot be compiled the install goes on and the
loop runs the same steps in Python. Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("foxhunt_stream.cuda._native_land", ["foxhunt_stream/cuda/native_land.c"],
                             optional=True)])
