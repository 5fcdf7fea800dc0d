from twisted.application.service import ServiceMaker

iopEdge = ServiceMaker(
    "iop Edge",
    "iop.edge.tap",
    "The iop Edge gateway: OpenAI-compatible and native APIs for Nodes that dial in.",
    "iop-edge",
)
