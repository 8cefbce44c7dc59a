import cupy

runtime = cupy.cuda.runtime   # the stand-in cupy's runtime, as the real package's module is cupy's
