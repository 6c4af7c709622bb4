"""A stand-in for the `kvcached` package, laid out as kvcached has it.

kvcached builds CUDA code and does not install on a machine without a GPU.
The series recognises kvcached's shortage error by its module and class
name (`kvcached.utils.KVCachePoolExhausted`), so tests need only a class
of that name in a module of that name: put this directory on sys.path.
"""
