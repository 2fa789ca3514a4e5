"""Datasets found in installed packages (nothing is downloaded), protocols and collators.

Images: ``data.images`` (Fashion-MNIST, MNIST-5k, digits, class folders), ``data.shapes`` (Shapes-HR,
procedural shapes rendered at any resolution), ``data.transforms`` (training augmentation and the
resolution-extrapolation evaluation protocol). Point clouds: ``data.points`` (CGAL shapes, procedural
shapes, rotation and point-count protocols). Video: ``data.video``, ``data.vniah``. Batching:
``data.collate`` (images of different sizes, point clouds; emits ``vlpe.Positions``).
"""
