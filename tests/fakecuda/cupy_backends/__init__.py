"""The stand-in's ``cupy_backends``: shadows a real one (the GPU machine has cupy installed),
so ``foxhunt_stream.cudart`` reaches the stand-in's runtime either way."""
