# The advisor on NVIDIA's PyTorch container: `docker build -t advisor .`, then
# `docker run --gpus all -p 127.0.0.1:7860:7860 --user "$(id -u):$(id -g)" -v "$PWD/traces:/workspace/traces" advisor`
# (README, "Containers"). container/advisor.def builds the same for Apptainer; tests/test_containers.py
# keeps the two and the Makefile in step.
#
# 25.12 is the newest release whose notes we have read
# (https://docs.nvidia.com/deeplearning/frameworks/pytorch-release-notes/rel-25-12.html, dated 2025-12-22):
# PyTorch 2.10.0a0+b4e4ee81d3 (inside requirements.txt's torch>=2.5,<2.15), CUDA 13.1.0, Python 3.12
# (/usr/local/lib/python3.12/dist-packages; we need >=3.10). CUDA 13 no longer supports Volta: for a V100
# take a CUDA 12 tag here and in container/advisor.def. The notes also say that since 25.03
# /etc/pip/constraint.txt pins every Python package the image was built with; we leave it in place.
# The part of those notes we could read does not list the bundled tools; NGC PyTorch images have
# carried Nsight Systems with their CUDA toolkit, and `nsys --version` after the install fails the build
# if it is not on the PATH, where `advisor profile --nsys` looks for it.
FROM nvcr.io/nvidia/pytorch:25.12-py3

# app.py binds ADVISOR_HOST (127.0.0.1 by default); a published port needs 0.0.0.0 inside the container.
# GRADIO_SERVER_NAME is the same for a launcher that leaves the address to Gradio. The run store is the
# volume below. HOME is under /tmp so that any uid given with `docker run --user` can write the caches
# (Triton's, and ~/.cache/advisor for --unified-memory).
ENV GRADIO_ANALYTICS_ENABLED=False \
    GRADIO_SERVER_NAME=0.0.0.0 \
    ADVISOR_HOST=0.0.0.0 \
    ADVISOR_TRACES_DIR=/workspace/traces \
    HOME=/tmp/home

WORKDIR /opt/advisor

# The image's CUDA torch must stay. Its version is a pre-release (2.10.0a0+...); pip accepts it for an
# installed torch, but a pin read from the image itself turns any attempt to replace it into a build
# error instead of a silent 2 GB download of another build. The Makefile's pinned CPU torch is not
# installed here for the same reason.
COPY requirements.txt ./
RUN python -c "from importlib.metadata import version; print('torch==' + version('torch'))" > /tmp/base-torch.txt \
    && python -m pip install --no-cache-dir -c /tmp/base-torch.txt -r requirements.txt \
    && rm /tmp/base-torch.txt \
    && nsys --version

# --no-deps: every dependency came from requirements.txt above, so pip never resolves torch again.
# Editable, the way the Makefile installs it (the test holds both to one way): rules/ and the other
# repo-relative paths then resolve in /opt/advisor.
COPY pyproject.toml README.md app.py ./
COPY advisor/ advisor/
COPY webui/ webui/
COPY rules/ rules/
RUN python -m pip install --no-cache-dir --no-deps -e .

# A uid clear of the base image's users (Ubuntu 24.04 images ship `ubuntu` as 1000); no home: HOME is /tmp/home.
RUN useradd --no-log-init --uid 10001 --user-group advisor \
    && mkdir -p /workspace/traces \
    && chown 10001:10001 /workspace/traces
USER 10001:10001
WORKDIR /workspace
VOLUME ["/workspace/traces"]
EXPOSE 7860

HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/' % os.environ.get('ADVISOR_PORT', '7860'), timeout=4)"]

# The base image's entrypoint prints its banner and runs this; `docker run ... advisor advisor profile ...`
# runs the CLI instead.
CMD ["advisor-app"]
