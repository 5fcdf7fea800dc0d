from twisted.application.service import ServiceMaker

iop_edge = ServiceMaker(
    "iop Edge",
    "iop.edge.tap",
    "The iop Edge gateway: OpenAI-compatible and native APIs for Nodes that dial in.",
    "iop-edge",
)
