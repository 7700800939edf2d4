# moto's server (PyPI `moto[server]`) with one fix and faults to order
# (at the end), started by moto.rs in place of the `moto_server` script.
#
# moto's SQS backend keeps the messages in flight in a set, and its server
# answers requests on several threads with no lock around it. A delete by
# an old receipt (which SQS accepts) racing a receive that delivers the
# same message again can leave the message in that set after it has left
# the queue: in a stress of moto 5.2.1 in process (a receive and a stale
# delete of one message on two threads), 120 rounds of 400 ended so. A
# FIFO queue then never delivers that message's group again, and the rest
# of the group stays in the queue for good. Amazon SQS has no such state.
# The fix drops, before and after every receive, the in-flight entries of
# messages no longer in the queue.
import sys

from moto.server import main
from moto.sqs import models, responses
from moto.sqs.exceptions import SQSException

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

# And one fault to order, as moto has no way to fail a request: a
# DeleteMessageBatch one of whose entries has the receipt handle
# FAIL_REQUEST (moto.rs: Moto::FAIL_REQUEST) is refused whole, deleting
# nothing, as SQS refuses a throttled request. The tests of a call that
# sends several requests fail one of the later ones with it.
FAIL_REQUEST = "pgonce-testkit-fail-this-request"

_delete_message_batch = responses.SQSResponse.delete_message_batch


def delete_message_batch(self):
    entries = self._get_param("Entries", [])
    if any(entry.get("ReceiptHandle") == FAIL_REQUEST for entry in entries):
        raise SQSException("RequestThrottled", "Rate exceeded (a fault the test asked for).")
    return _delete_message_batch(self)


responses.SQSResponse.delete_message_batch = delete_message_batch

# The same for sends: a SendMessageBatch one of whose entries has the body
# FAIL_REQUEST is refused whole, sending nothing; an entry with the body
# FAIL_ENTRY (Moto::FAIL_ENTRY) is refused alone, reported in the answer's
# Failed list as SQS reports an entry KMS throttled, and the others are
# sent, as SQS answers a request it took in part.
FAIL_ENTRY = "pgonce-testkit-fail-this-entry"

_send_message_batch = responses.SQSResponse.send_message_batch
_backend_send_message_batch = models.SQSBackend.send_message_batch


def send_message_batch(self):
    entries = self._get_param("Entries", [])
    if any(entry.get("MessageBody") == FAIL_REQUEST for entry in entries):
        raise SQSException("RequestThrottled", "Rate exceeded (a fault the test asked for).")
    refused = {e["Id"] for e in entries if e.get("MessageBody") == FAIL_ENTRY}
    result = _send_message_batch(self)
    # moto words every entry it refuses as a bad delay, its SenderFault a
    # string, which the Rust SDK does not parse: these say what they are.
    for failed in result.result["Failed"]:
        if failed["Id"] in refused:
            failed.update(
                SenderFault=False,
                Code="KMS.ThrottlingException",
                Message="Rate exceeded (a fault the test asked for).",
            )
    return result


def backend_send_message_batch(self, queue_name, entries):
    refused = [e for e in entries.values() if e.get("MessageBody") == FAIL_ENTRY]
    rest = {k: e for k, e in entries.items() if e.get("MessageBody") != FAIL_ENTRY}
    messages, failed = _backend_send_message_batch(self, queue_name, rest)
    return messages, failed + refused


responses.SQSResponse.send_message_batch = send_message_batch
models.SQSBackend.send_message_batch = backend_send_message_batch

# And a SendMessage whose body holds FAIL_REQUEST anywhere (a service
# wraps what its caller gave in a body of its own) is refused the same
# way, sending nothing.
_send_message = responses.SQSResponse.send_message


def send_message(self):
    if FAIL_REQUEST in (self._get_param("MessageBody") or ""):
        raise SQSException("RequestThrottled", "Rate exceeded (a fault the test asked for).")
    return _send_message(self)


responses.SQSResponse.send_message = send_message
sys.exit(main(sys.argv[1:]))
