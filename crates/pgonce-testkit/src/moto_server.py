# moto's server (PyPI `moto[server]`) with one fix, started by moto.rs in
# place of the `moto_server` script.
#
# moto's SQS backend receives without a lock, and its server answers
# requests on several threads. When one receive moves a message to the
# dead-letter queue while another receive is marking the same message in
# flight, the message is left in the queue's set of pending (in-flight)
# messages after it has left the queue. A FIFO queue then never delivers
# that message's group again: the rest of the group stays in the queue for
# good. Amazon SQS has no such state. The fix drops, before and after every
# receive, the pending entries of messages no longer in the queue.
import sys

from moto.server import main
from moto.sqs import models

_receive_message = models.SQSBackend.receive_message


def _forget_departed(queue):
    queue._pending_messages.intersection_update(queue._messages)


def receive_message(self, queue_name, *args, **kwargs):
    queue = self.get_queue(queue_name)
    _forget_departed(queue)
    try:
        return _receive_message(self, queue_name, *args, **kwargs)
    finally:
        _forget_departed(queue)


models.SQSBackend.receive_message = receive_message
sys.exit(main(sys.argv[1:]))
